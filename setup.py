from setuptools import find_packages, setup

setup(
    name="sglang-vericache",
    version="0.1.0",
    description="SGLang-style serving runtime that turns lossy KV-cache compression into lossless inference",
    package_dir={"": "python"},
    packages=find_packages("python"),
    package_data={"sglang_vericache": ["assets/*/*", "assets/*/kvzap/*"]},  # + the KVzap surrogate
    include_package_data=True,
    python_requires=">=3.10",
    # torch is installed separately (requirements/torch-cpu.txt) so a CPU install never pulls CUDA wheels;
    # sglang goes in with --no-deps (requirements/sglang-nodeps.txt).
    install_requires=[
        line.strip()
        for line in open("requirements/runtime.txt")
        if line.strip() and not line.startswith("#")
    ],
    entry_points={"console_scripts": ["sglang-vericache=sglang_vericache.launch_server:main"]},
)
