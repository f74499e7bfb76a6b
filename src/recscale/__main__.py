"""`python -m recscale ...` (the form torchrun launches) is the same as the `recscale` command."""

from recscale.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
