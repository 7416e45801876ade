"""Imported once by the multiprocessing fork server, before it forks any rank's worker.

A rank's first seconds are imports (torch, torch.distributed, transformers' config
machinery: about 8 s on a 2-core machine, paid by every rank at once). Imported here,
the fork server pays them once per engine process and every worker it forks starts
with them loaded; no CUDA context exists yet, so forking stays safe.
"""

import torch  # noqa: F401
import torch.distributed  # noqa: F401
import transformers.activations  # noqa: F401  # pulls the slow part of transformers
from transformers import AutoConfig  # noqa: F401

import archserve.engine.parallel_runner  # noqa: F401
import archserve.loader.loader  # noqa: F401
