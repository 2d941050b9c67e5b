"""Tensor parallelism on torch.distributed: the rank's group (parallel_state) and the scheduler's
typed broadcast of new requests from rank 0 (request_broadcast)."""
