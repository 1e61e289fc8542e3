"""`python -m bench`: the README's main job.

For now it runs the CPU comparison against torch.nn (bench/cpu_vs_torch.py);
the benchmark-suite issue grows it into the full suite.
"""
from .cpu_vs_torch import main

if __name__ == "__main__":
    main()
