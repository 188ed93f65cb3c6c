"""``python -m kvaudit``: the ``kvaudit`` command."""

from .cli import main

if __name__ == "__main__":
    main(prog_name="kvaudit")
