"""``python -m attnlab`` runs the command line tool."""

from attnlab.cli import main

if __name__ == "__main__":
    main()
