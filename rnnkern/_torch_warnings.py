"""Keeps one of torch's warnings, noise for CPU users, out of their way.

On a machine without a GPU, a CUDA build of torch logs

    No CUDA runtime is found, using CUDA_HOME='/usr/local'

when ``torch.utils.cpp_extension`` is first imported and a CUDA toolkit can be
guessed (``CUDA_HOME`` / ``CUDA_PATH`` set, an ``nvcc`` on PATH, or
``/usr/local/cuda``).  rnnkern never imports that module at run time (its kernels
are compiled at install time), but two parts of torch do, for C++ that runs on the
CPU: Inductor, for the include paths of the code it generates (the first
``torch.compile`` of any model on CPU tensors), and ``torch.utils.benchmark``, on
import (``python -m bench``).  For them the CUDA toolkit plays no part, and "no
CUDA runtime" is what ``torch.cuda.is_available()`` already says.

So the record is dropped when one of those two is the importer, and only then: a
user's own CUDA extension build (``torch.utils.cpp_extension.load`` / ``setup.py``)
still gets the warning, where the CUDA_HOME in it matters; so does every other
record of that logger.
"""
from __future__ import annotations

import logging
import sys

#: The message, as torch.utils.cpp_extension._find_cuda_home logs it (format string).
CUDA_HOME_GUESS = "No CUDA runtime is found, using CUDA_HOME='%s'"
#: Parts of torch that import cpp_extension only to compile C++ for the CPU.
CPU_ONLY_IMPORTERS = ("torch._inductor", "torch.utils.benchmark")


class DropCudaHomeGuessForCpuCode(logging.Filter):
    """Drops :data:`CUDA_HOME_GUESS` when a module of :data:`CPU_ONLY_IMPORTERS` is on
    the call stack (the record is logged once per process, while cpp_extension is
    being imported, so the walk up the stack is cheap)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != CUDA_HOME_GUESS:
            return True
        frame = sys._getframe(1)
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            if any(module == name or module.startswith(name + ".") for name in CPU_ONLY_IMPORTERS):
                return False
            frame = frame.f_back
        return True


def install() -> None:
    """Adds the filter to torch.utils.cpp_extension's logger, once."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    if not any(isinstance(f, DropCudaHomeGuessForCpuCode) for f in logger.filters):
        logger.addFilter(DropCudaHomeGuessForCpuCode())
