"""`python -m sglang_vericache.launch_server [flags]`: check the model folder, then serve.

A missing model folder, or one without config.json, is a one-line error on stderr and exit code 2,
before any process is spawned or any heavy module is imported.
"""

from __future__ import annotations

import logging
import os
import sys

from sglang_vericache.server_args import ServerArgs, prepare_server_args


def model_folder_error(server_args: ServerArgs) -> str | None:
    path = server_args.model_path
    if not os.path.isdir(path):
        return f"model folder not found: {path} (--model-path must be a local Hugging Face model folder)"
    if not os.path.isfile(os.path.join(path, "config.json")):
        return f"model folder {path} has no config.json (not a Hugging Face model folder)"
    tok = server_args.tokenizer_path
    if not server_args.skip_tokenizer_init and tok != path and not os.path.isdir(tok):
        return f"tokenizer folder not found: {tok}"
    return None


def main(argv: list[str] | None = None) -> None:
    server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    error = model_folder_error(server_args)
    if error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(
        level=server_args.log_level.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s"
    )
    if server_args.disagg_role == "verifier":  # dual-instance mode: no HTTP, the verifier loop (disagg/)
        from sglang_vericache.disagg.verifier import run_verifier

        run_verifier(server_args)
        return
    from sglang_vericache.managers.tokenizer_manager import TokenizerManager

    try:
        manager = TokenizerManager(server_args)  # spawns the scheduler first: it loads while we import
    except (RuntimeError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    from sglang_vericache.entrypoints.http_server import launch_server

    launch_server(server_args, manager)


if __name__ == "__main__":
    main()
