"""``python -m jaxreshard``: the same command line as the ``jaxreshard`` script."""

from jaxreshard._cli import main

if __name__ == "__main__":
  main()
