"""`python -m tokenspeed_worker`: the same as the `tokenspeed-worker` command."""

from tokenspeed_worker.cli import main

if __name__ == "__main__":
    main()
