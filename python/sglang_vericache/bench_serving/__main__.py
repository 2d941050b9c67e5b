from sglang_vericache.bench_serving.cli import main

main()
