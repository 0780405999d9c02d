"""The ``.data/serialization_id`` record torch's zip writer adds at the end of a torch.save file, computed without torch.

``caffe2::serialize::PyTorchStreamWriter::writeSerializationId`` (``caffe2/serialize/inline_container.cc``)
writes 40 ASCII digits: the record names' hashes folded with ``c10::hash_combine`` in the iteration
order of the ``std::unordered_set<std::string>`` holding them, then the CRC-32 fields of the data
descriptors written, folded the same way in the order written, each as 20 zero-padded decimal
digits. Both are deterministic, so the file's bytes are too. This module computes them as a Linux
build of torch does, over libstdc++: its ``std::hash<std::string>`` (``std::_Hash_bytes``) and its
hash table's bucket counts and node order. A torch built against another C++ library writes
another id; ``torch.load`` reads the id but never checks it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

__all__ = ["serialization_id", "std_string_hash", "hash_combine", "unordered_set_order", "PRIME_LIST"]

_MASK = (1 << 64) - 1
_MUL = (0xC6A4A793 << 32) + 0x5BD1E995  # _Hash_bytes' multiplier (64-bit size_t)
_SEED = 0xC70F6907  # std::hash<std::string>'s seed

# libstdc++'s std::__detail::__prime_list (64-bit), the bucket counts its hash tables grow through,
# without its trailing sentinel; tests/unit/test_torch_zip.py checks it against the one libstdc++ exports
# fmt: off
PRIME_LIST = (
    2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 103, 109, 113, 127,
    137, 139, 149, 157, 167, 179, 193, 199, 211, 227, 241, 257, 277, 293, 313, 337, 359, 383, 409, 439, 467, 503, 541,
    577, 619, 661, 709, 761, 823, 887, 953, 1031, 1109, 1193, 1289, 1381, 1493, 1613, 1741, 1879, 2029, 2179, 2357,
    2549, 2753, 2971, 3209, 3469, 3739, 4027, 4349, 4703, 5087, 5503, 5953, 6427, 6949, 7517, 8123, 8783, 9497, 10273,
    11113, 12011, 12983, 14033, 15173, 16411, 17749, 19183, 20753, 22447, 24281, 26267, 28411, 30727, 33223, 35933,
    38873, 42043, 45481, 49201, 53201, 57557, 62233, 67307, 72817, 78779, 85229, 92203, 99733, 107897, 116731, 126271,
    136607, 147793, 159871, 172933, 187091, 202409, 218971, 236897, 256279, 277261, 299951, 324503, 351061, 379787,
    410857, 444487, 480881, 520241, 562841, 608903, 658753, 712697, 771049, 834181, 902483, 976369, 1056323, 1142821,
    1236397, 1337629, 1447153, 1565659, 1693859, 1832561, 1982627, 2144977, 2320627, 2510653, 2716249, 2938679,
    3179303, 3439651, 3721303, 4026031, 4355707, 4712381, 5098259, 5515729, 5967347, 6456007, 6984629, 7556579,
    8175383, 8844859, 9569143, 10352717, 11200489, 12117689, 13109983, 14183539, 15345007, 16601593, 17961079,
    19431899, 21023161, 22744717, 24607243, 26622317, 28802401, 31160981, 33712729, 36473443, 39460231, 42691603,
    46187573, 49969847, 54061849, 58488943, 63278561, 68460391, 74066549, 80131819, 86693767, 93793069, 101473717,
    109783337, 118773397, 128499677, 139022417, 150406843, 162723577, 176048909, 190465427, 206062531, 222936881,
    241193053, 260944219, 282312799, 305431229, 330442829, 357502601, 386778277, 418451333, 452718089, 489790921,
    529899637, 573292817, 620239453, 671030513, 725980837, 785430967, 849749479, 919334987, 994618837, 1076067617,
    1164186217, 1259520799, 1362662261, 1474249943, 1594975441, 1725587117, 1866894511, 2019773507, 2185171673,
    2364114217, 2557710269, 2767159799, 2993761039, 3238918481, 3504151727, 3791104843, 4101556399, 4294967291,
    6442450933, 8589934583, 12884901857, 17179869143, 25769803693, 34359738337, 51539607367, 68719476731, 103079215087,
    137438953447, 206158430123, 274877906899, 412316860387, 549755813881, 824633720731, 1099511627689, 1649267441579,
    2199023255531, 3298534883309, 4398046511093, 6597069766607, 8796093022151, 13194139533241, 17592186044399,
    26388279066581, 35184372088777, 52776558133177, 70368744177643, 105553116266399, 140737488355213, 211106232532861,
    281474976710597, 562949953421231, 1125899906842597, 2251799813685119, 4503599627370449, 9007199254740881,
    18014398509481951, 36028797018963913, 72057594037927931, 144115188075855859, 288230376151711717,
    576460752303423433, 1152921504606846883, 2305843009213693951, 4611686018427387847, 9223372036854775783,
    18446744073709551557,
)
# fmt: on
_FAST_BUCKETS = (2, 2, 2, 3, 5, 5, 7, 7, 11, 11, 11, 11, 13, 13)  # _Prime_rehash_policy::_M_next_bkt's __fast_bkt
_EMPTY, _BEFORE_BEGIN, _END = -1, -2, -1


def _shift_mix(v: int) -> int:
    return v ^ (v >> 47)


def std_string_hash(data: bytes) -> int:
    """``std::hash<std::string>`` of libstdc++ on a 64-bit system: ``std::_Hash_bytes(data, len, 0xc70f6907)``.

    Args:
        data: the string's bytes (a record name, UTF-8).

    Returns:
        The 64-bit hash.
    """
    length = len(data)
    h = (_SEED ^ (length * _MUL)) & _MASK
    aligned = length & ~7
    for i in range(0, aligned, 8):
        h ^= (_shift_mix((int.from_bytes(data[i : i + 8], "little") * _MUL) & _MASK) * _MUL) & _MASK
        h = (h * _MUL) & _MASK
    if length & 7:
        h ^= int.from_bytes(data[aligned:], "little")
        h = (h * _MUL) & _MASK
    return _shift_mix((_shift_mix(h) * _MUL) & _MASK)


def hash_combine(seed: int, value: int) -> int:
    """``c10::hash_combine`` on 64-bit ``size_t``: ``seed ^ (value + 0x9e3779b9 + (seed << 6) + (seed >> 2))``."""
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _MASK)) & _MASK


def _next_bucket_count(n: int) -> tuple[int, int]:
    """``_Prime_rehash_policy::_M_next_bkt(n)`` (max load factor 1): the bucket count and the next resize."""
    if n < len(_FAST_BUCKETS):
        return _FAST_BUCKETS[n], _FAST_BUCKETS[n]
    last = len(PRIME_LIST) - 1  # lower_bound over [6, last): the last prime is never passed
    i = bisect.bisect_left(PRIME_LIST, n, 6, last)
    return PRIME_LIST[i], (_MASK if i == last else PRIME_LIST[i])


def _rehash(head: int, nxt: list[int], codes: Sequence[int], count: int) -> tuple[int, list[int]]:
    """``_Hashtable::_M_rehash_aux`` (unique keys): the nodes relinked, in list order, into ``count`` buckets."""
    buckets = [_EMPTY] * count  # per bucket: the node before its first node, or _BEFORE_BEGIN
    new_head, first_bucket, p = _END, 0, head
    while p != _END:
        after = nxt[p]
        b = codes[p] % count
        before = buckets[b]
        if before == _EMPTY:
            nxt[p], new_head = new_head, p
            buckets[b] = _BEFORE_BEGIN
            if nxt[p] != _END:
                buckets[first_bucket] = p
            first_bucket = b
        elif before == _BEFORE_BEGIN:
            nxt[p], new_head = new_head, p
        else:
            nxt[p], nxt[before] = nxt[before], p
        p = after
    return new_head, buckets


def unordered_set_order(codes: Sequence[int]) -> list[int]:
    """The order a libstdc++ ``std::unordered_set`` iterates distinct keys inserted in the order given.

    Emulates ``_Hashtable::_M_insert_unique_node``: the growth policy (13 buckets at first, then
    the next prime of ``PRIME_LIST`` past double), a node whose bucket is empty put at the list's
    front, one whose bucket is in use put first in that bucket, and the relinking of each rehash.

    Args:
        codes: the keys' hash codes, in insertion order (no key twice).

    Returns:
        Positions in ``codes``, in iteration order.
    """
    nxt = [_END] * len(codes)
    head, count, next_resize = _END, 1, 0
    buckets = [_EMPTY]
    for i, code in enumerate(codes):
        if i + 1 > next_resize:  # _M_need_rehash(count, i, 1)
            wanted = max(i + 1, 0 if next_resize else 11)
            if wanted >= count:
                count, next_resize = _next_bucket_count(max(wanted + 1, count * 2))
                head, buckets = _rehash(head, nxt, codes, count)
            else:
                next_resize = count
        b = code % count
        before = buckets[b]
        if before == _EMPTY:
            nxt[i], head = head, i
            if nxt[i] != _END:
                buckets[codes[nxt[i]] % count] = i
            buckets[b] = _BEFORE_BEGIN
        elif before == _BEFORE_BEGIN:
            nxt[i], head = head, i
        else:
            nxt[i], nxt[before] = nxt[before], i
    order, p = [], head
    while p != _END:
        order.append(p)
        p = nxt[p]
    return order


def serialization_id(names: Sequence[str], descriptor_crcs: Iterable[int]) -> bytes:
    """The 40 ASCII digits torch's writer stores in ``.data/serialization_id``.

    Args:
        names: every record written before it (``version`` and ``byteorder`` included), without
            the archive folder, in the order written.
        descriptor_crcs: the CRC-32 field of each data descriptor written, in order (all 0
            where the writer computes no CRC-32).

    Returns:
        The record's bytes.
    """
    codes = [std_string_hash(name.encode()) for name in names]
    names_hash = 0
    for i in unordered_set_order(codes):
        names_hash = hash_combine(names_hash, codes[i])
    crcs_hash = 0
    for crc in descriptor_crcs:
        crcs_hash = hash_combine(crcs_hash, crc)
    return f"{names_hash:020d}{crcs_hash:020d}".encode()
