"""Tensor parallelism: process groups (gloo on CPU, NCCL on CUDA), how a model splits over
ranks, the start-up agreement between ranks, and the executors that drive one worker
process per rank (multiprocessing on one machine; Ray across machines)."""
