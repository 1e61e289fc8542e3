"""`python -m bench`: the README's main job (see bench/README.md and bench/suite.py)."""
from .suite import main

if __name__ == "__main__":
    main()
