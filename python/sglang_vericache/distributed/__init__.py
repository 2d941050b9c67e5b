"""Tensor parallelism on torch.distributed: the rank's group (parallel_state). The scheduler's typed
broadcast of new requests from rank 0 is managers/request_broadcast.py."""
