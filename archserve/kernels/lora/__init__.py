"""LoRA adapter deltas: the slots and step mapping they read (interface.py), the grouped
Triton kernels, the torch path and the reference, and the backend rules."""
