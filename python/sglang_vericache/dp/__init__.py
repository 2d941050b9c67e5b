"""Data parallelism (`launch_server --dp-size N`): N replicas of one server behind sglang-router.

- `router_flags`: the router's own flags, `--router-` prefixed as in SGLang's
  `sglang_router.launch_server`, and the RouterArgs launch_server hands the router;
- `router_process`: the router's child process (`python -m sglang_vericache.dp.router_process`);
- `replica`: one replica, a full `launch_server` of ours on an internal loopback port;
- `front`: the HTTP front on --host:--port (its own /server_info, everything else to the router);
- `controller`: starts, supervises and stops them.
"""
