"""`python -m kvtier` runs the `kvtier` command line."""

from kvtier.cli import main

if __name__ == "__main__":
    main()
