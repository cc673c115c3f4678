"""Kernel DSOs and their binding to kernel slots: build, strict manifest, loading, ABI checks."""
from pipeline.kernels.build import build_kernel
from pipeline.kernels.bind import BoundKernel, bind
from pipeline.kernels.manifest import Binding, Manifest, load_manifest

__all__ = ["Binding", "BoundKernel", "Manifest", "bind", "build_kernel", "load_manifest"]
