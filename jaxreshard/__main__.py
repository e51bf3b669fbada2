"""``python -m jaxreshard``: the same command line as the ``jaxreshard`` script."""

from jaxreshard._src.cli.commands import main

if __name__ == "__main__":
  main()
