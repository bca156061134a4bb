"""What the GPU check needs beyond what the lent GPU machine has (../.library/device/KINDS.md:
Python 3.12, a CUDA torch, numpy, pyarrow, safetensors, pyyaml, psutil, ...; no Ray, MLflow or
pydantic, and no network). `make gpu-wheels` downloads these, at the versions installed here,
as Python 3.12 wheels into `.whl/`, which travels with the tree (a few MB) and
`benchmarks/gpu_check.sh` installs there with `pip --no-index --target`.

    python benchmarks/gpu_wheels.py        # the pins, one `name==version` per line
"""

from __future__ import annotations

from importlib.metadata import version

# Distributions to carry: pydantic (the config tree) and what it needs. typing-extensions is
# on that machine too, but pydantic wants a recent one.
CARRIED = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions")

# Top-level modules of packages that machine has and that the Ray-free path may import
# (torch and what it imports; the project's own imports), by import name.
DEVICE_MODULES = frozenset(
    {
        "torch", "torchgen", "functorch", "triton", "nvidia", "cuda", "sympy", "mpmath",
        "networkx", "jinja2", "markupsafe", "filelock", "fsspec", "numpy", "pyarrow",
        "safetensors", "yaml", "_yaml", "psutil", "packaging", "setuptools", "_distutils_hack",
        "pkg_resources", "typing_extensions", "tokenizers", "opt_einsum", "optree", "tqdm",
        "cloudpickle",
    }
)  # fmt: skip


def carried_modules() -> frozenset[str]:
    """The import names of the carried distributions."""
    return frozenset(name.replace("-", "_") for name in CARRIED)


def pins() -> list[str]:
    return [f"{name}=={version(name)}" for name in CARRIED]


if __name__ == "__main__":
    print("\n".join(pins()))
