"""fsdp_convert.progress: binary units, no rate before the warm-up, silence when off, stderr only, every worker's bytes."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import pytest
from rich.console import Console

from fsdp_convert import progress as progress_mod
from fsdp_convert.progress import PROGRESS_LOG_ENV, WARMUP_S, Bars, ByteBar, StepProgress, clock_text, human_bytes

GiB = 1 << 30


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class DictCounter:
    """A job's shared counter (what launch.JobCounter does with the c10d store), in memory."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}
        self.adds = 0
        self.lock = threading.Lock()

    def add(self, name: str, amount: int) -> int:
        with self.lock:
            self.adds += amount != 0
            self.values[name] = self.values.get(name, 0) + amount
            return self.values[name]


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=120, force_terminal=False), out


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (1_060_000_000, "1010.9 MiB"),
        (4_840_000_000, "4.5 GiB"),
        (5 << 40, "5.0 TiB"),
        (3 << 50, "3072.0 TiB"),
    ],
)
def test_human_bytes_counts_in_binary_units(n: int, text: str) -> None:
    assert human_bytes(n) == text


@pytest.mark.parametrize(("n", "text"), [(999, "999 B"), (1000, "1.0 kB"), (3_400_000_000, "3.4 GB"), (7 * 10**15, "7000.0 TB")])
def test_human_bytes_counts_free_space_in_decimal_units_as_df_h(n: int, text: str) -> None:
    assert human_bytes(n, units="decimal") == text


def test_human_bytes_is_the_clis() -> None:
    from fsdp_convert.cli._output import human_bytes as cli_human_bytes

    for n in (0, 1, 1023, 1024, 10**6, 4_840_000_000, 2**45, 2**52):
        assert human_bytes(n) == cli_human_bytes(n)


def test_clock_text() -> None:
    assert clock_text(0) == "0:00:00"
    assert clock_text(75.4) == "0:01:15"
    assert clock_text(3 * 3600 + 61) == "3:01:01"
    assert clock_text(-3) == "0:00:00"


def test_first_frame_has_no_rate_or_eta() -> None:
    clock = FakeClock()
    bar = ByteBar("write", 4_840_000_000, enabled=False, clock=clock)
    bar.start()
    assert bar.frame() == "write   0% 0 B/4.5 GiB"
    clock.now += 1e-6  # the absurd first frame: 25 bytes in a microsecond
    bar.update(25)
    assert bar.rate() is None
    assert bar.frame() == "write   0% 25 B/4.5 GiB"
    clock.now += WARMUP_S / 2
    bar.update(1 << 20)
    assert "/s" not in bar.frame() and "eta" not in bar.frame()


def test_rate_and_eta_after_the_warm_up() -> None:
    clock = FakeClock()
    bar = ByteBar("write", 4 * GiB, enabled=False, clock=clock)
    bar.start()
    for _ in range(4):
        clock.now += 0.25
        bar.update(bar.done_bytes + 64 * 2**20)  # 256 MiB/s
    assert bar.rate() == pytest.approx(256 * 2**20)
    assert bar.frame() == "write   6% 256.0 MiB/4.0 GiB 256.0 MiB/s eta 0:00:15"


def test_rate_follows_the_recent_window() -> None:
    clock = FakeClock()
    bar = ByteBar("write", 100 * GiB, enabled=False, clock=clock)
    bar.start()
    for _ in range(60):  # a minute at 1 GiB/s, then 20 s at 100 MiB/s
        clock.now += 1
        bar.update(bar.done_bytes + GiB)
    for _ in range(20):
        clock.now += 1
        bar.update(bar.done_bytes + 100 * 2**20)
    assert bar.rate() == pytest.approx(100 * 2**20)


def test_kept_bytes_are_done_but_not_in_the_rate() -> None:
    clock = FakeClock()
    bar = ByteBar("write", 10 * GiB, enabled=False, clock=clock)
    bar.start()
    clock.now += 1
    bar.update(5 * GiB + 2**20, moved_bytes=2**20)  # 5 GiB kept from an interrupted run
    assert bar.rate() == pytest.approx(2**20)
    assert bar.frame().startswith("write  50% 5.0 GiB/10.0 GiB 1.0 MiB/s eta ")


def test_last_frame_gives_mean_rate_and_time_taken() -> None:
    clock = FakeClock()
    console, out = _console()
    bar = ByteBar("write", 3 * GiB, console=console, clock=clock)
    bar.start()
    clock.now += 12
    bar.update(3 * GiB)
    bar.close()
    assert bar.frame() == "write 100% 3.0 GiB/3.0 GiB 256.0 MiB/s in 0:00:12"
    text = out.getvalue()
    # not a terminal: the last frame only, bar included
    assert text.count("write") == 1
    assert "━" in text and "100% 3.0 GiB/3.0 GiB 256.0 MiB/s in 0:00:12" in text


def test_terminal_frames_redraw_in_place() -> None:
    clock = FakeClock()
    out = io.StringIO()
    bar = ByteBar("write", GiB, console=Console(file=out, width=120, force_terminal=True), clock=clock)
    bar.start()
    for _ in range(4):
        clock.now += 0.25
        bar.update(bar.done_bytes + GiB // 4)
    bar.close()
    text = out.getvalue()
    assert text.count("write") >= 5  # every frame drawn
    assert "\x1b[" in text  # cursor moves: in place
    assert "1.0 GiB/1.0 GiB" in text


def test_an_empty_step_ends_at_100_percent() -> None:
    console, out = _console()
    bar = ByteBar("verify", 0, console=console, clock=FakeClock())
    bar.start()
    bar.close()
    assert "100% 0 B/0 B in 0:00:00" in out.getvalue()


def test_disabled_writes_nothing(capfd: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROGRESS_LOG_ENV, str(tmp_path))
    console, out = _console()
    bar = ByteBar("write", GiB, enabled=False, console=console)
    bar.start()
    bar.update(GiB)
    bar.close()
    counter = DictCounter()
    with StepProgress("write", "write", GiB, enabled=False, show=True, shared=counter, console=console) as step:
        step.advance(GiB)
        step.keep(5)
        step.flush()
    assert step.totals() == (0, 0)
    assert out.getvalue() == ""
    assert counter.values == {}  # off: no traffic to the job's store
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""
    assert list(tmp_path.iterdir()) == []


def test_bar_writes_to_stderr_never_stdout(capfd: pytest.CaptureFixture[str]) -> None:
    # the default console: stderr, found at each write
    with StepProgress("write", "write", 8 << 20, enabled=True, show=True) as step:
        for _ in range(8):
            step.advance(1 << 20)
    captured = capfd.readouterr()
    assert captured.out == ""
    assert "write" in captured.err and "100% 8.0 MiB/8.0 MiB" in captured.err


def test_every_workers_bytes_reach_the_shown_bar(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(PROGRESS_LOG_ENV, str(tmp_path))
    counter = DictCounter()
    console, out = _console()
    shown = StepProgress("write", "write", 3 * GiB, enabled=True, show=True, shared=counter, console=console)
    other = StepProgress("write", "write", 3 * GiB, enabled=True, show=False, shared=counter, console=console)
    with shown, other:
        for _ in range(1024):
            other.advance(2**20)  # rank 1: 1 GiB, in MiB pieces
        other.keep(GiB)  # rank 1: 1 GiB kept from an interrupted run
        shown.advance(GiB)
        other.flush()  # before the job's last collective
    assert shown.bar.done_bytes == 3 * GiB and shown.bar.moved_bytes == 2 * GiB
    assert "100% 3.0 GiB/3.0 GiB" in out.getvalue()
    assert out.getvalue().count("write") == 1  # the other worker draws nothing
    assert counter.values == {"write/moved": 2 * GiB, "write/kept": GiB}
    (log,) = tmp_path.iterdir()
    (line,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert line["done_bytes"] == line["total_bytes"] == 3 * GiB
    assert line["frame"].startswith("write 100% 3.0 GiB/3.0 GiB")


def test_adds_to_the_store_are_throttled(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    counter = DictCounter()
    step = StepProgress("write", "write", GiB, enabled=True, show=False, shared=counter, clock=clock)
    for _ in range(63):
        step.advance(2**20)
    assert counter.adds == 0  # under PUSH_BYTES and PUSH_S
    step.advance(2**20)
    assert counter.adds == 1 and counter.values["write/moved"] == 64 * 2**20
    step.advance(1)
    clock.now += progress_mod.PUSH_S
    step.advance(1)
    assert counter.adds == 2 and counter.values["write/moved"] == 64 * 2**20 + 2


def test_a_lost_store_falls_back_to_this_workers_bytes(caplog: pytest.LogCaptureFixture) -> None:
    class LostStore:
        def add(self, name: str, amount: int) -> int:
            raise RuntimeError("Connection reset by peer")

    console, out = _console()
    with StepProgress("write", "write", 2 * GiB, enabled=True, show=True, shared=LostStore(), console=console) as step:
        step.advance(GiB)
        step.flush()
        step.advance(GiB)
    assert step.totals() == (2 * GiB, 2 * GiB)
    assert "100% 2.0 GiB/2.0 GiB" in out.getvalue()


def test_bars_without_a_shared_counter_count_rank_0s_share() -> None:
    step = Bars(enabled=True, show=True, whole_job=False).step("write", "write", 10 * GiB, 3 * GiB)
    assert step.bar.description == "write (rank 0's share)"
    assert step.bar.total_bytes == 3 * GiB
    whole = Bars(enabled=True, show=True).step("write", "write", 10 * GiB, 3 * GiB)
    assert (whole.bar.description, whole.bar.total_bytes) == ("write", 10 * GiB)


def test_a_failed_step_leaves_its_frame_as_it_stood() -> None:
    console, out = _console()
    with pytest.raises(OSError), StepProgress("write", "write", 2 * GiB, enabled=True, show=True, console=console) as step:
        step.advance(GiB)
        raise OSError("No space left on device")
    assert "50% 1.0 GiB/2.0 GiB" in out.getvalue()
    assert " in 0:" not in out.getvalue()


def test_job_counter_counts_every_workers_adds_per_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from fsdp_convert.launch import JobCounter, WorkerGroup, worker_bars

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the job's (the agent's) store
    rank0, rank1 = JobCounter("127.0.0.1", store.port, 0), JobCounter("127.0.0.1", store.port, 1)
    rank0.add("write/moved", 5)
    assert rank1.add("write/moved", 7) == 12 == rank0.add("write/moved", 0)
    # the same workers' next run (a wave under one torchrun) counts from 0 on the same store
    again0, again1 = JobCounter("127.0.0.1", store.port, 0), JobCounter("127.0.0.1", store.port, 1)
    assert again0.add("write/moved", 0) == 0
    again1.add("write/moved", 3)
    assert again0.add("write/moved", 0) == 3 and rank0.add("write/moved", 0) == 12

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    bars = worker_bars(True, 1, WorkerGroup())
    assert isinstance(bars.shared, JobCounter) and bars.whole_job and not bars.show
    assert worker_bars(True, 0, None) == Bars(enabled=True, show=True)  # one process: counts alone, the whole job
    assert worker_bars(False, 0, WorkerGroup()).shared is None  # off: no store
    monkeypatch.delenv("MASTER_ADDR")  # a group joined without the launcher's store: each worker's own share
    assert worker_bars(True, 0, WorkerGroup()) == Bars(enabled=True, show=True, whole_job=False)
