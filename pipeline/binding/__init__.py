"""Kernel DSOs and their binding to kernel slots: build, strict manifest, loading, ABI checks."""
from pipeline.binding.kernel_build import build_kernel
from pipeline.binding.loader import BoundKernel, bind
from pipeline.binding.manifest import Binding, Manifest, load_manifest

__all__ = ["Binding", "BoundKernel", "Manifest", "bind", "build_kernel", "load_manifest"]
