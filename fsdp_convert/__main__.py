"""``python -m fsdp_convert``: run the CLI."""

from fsdp_convert.cli import main

if __name__ == "__main__":
    main()
