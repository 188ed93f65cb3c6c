"""An import-only stand-in for torchvision, for the SGLang stage on a CPU-only torch.

Why it exists: ``sglang.srt.mem_cache.memory_pool`` (SGLang 0.5.23) imports
``sglang.srt.configs``, whose ``__init__`` imports ``configs/nano_nemotron_vl.py`` ->
``multimodal/internvl_utils.py`` (``import torchvision.transforms as T``) and
``configs/deepseek_ocr.py`` (``from torchvision.transforms import functional``) at module
level, so no KV pool of SGLang imports without some torchvision. The real one cannot be had
here: PyPI's Linux wheel for torch 2.13 (torchvision 0.28.0) links CUDA torch
(``_C.so`` needs ``libc10_cuda.so``) and then fails at import on the CPU build
(``RuntimeError: operator torchvision::nms does not exist``).

What it does: it serves every ``torchvision`` and ``torchvision.*`` import (transformers
finds torchvision by ``importlib.util.find_spec``, then imports ``torchvision.io`` and
``torchvision.transforms.v2`` too), and nothing more. It is import-time only: a lowercase
attribute is a stand-in submodule, any other attribute a stand-in class, and calling either,
or reading an attribute of a stand-in class, raises ``RuntimeError``. The one real name is
the enum ``InterpolationMode`` (plain strings, as torchvision's): transformers'
``image_utils`` maps PIL's resampling filters to its members at import. No test of the stage
touches SGLang's or transformers' image code, so nothing should ever get further.

It is used only where no torchvision is installed (``tests/sglang/conftest.py`` puts this
folder on ``sys.path`` only then). What would remove the need: SGLang importing
torchvision lazily in ``sglang.srt.configs`` (as ``configs/deepseekvl2.py`` already does), or
a torchvision wheel built against the CPU torch that the stage installs.
"""

from __future__ import annotations

import enum
import importlib
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+kvaudit.standin"


class InterpolationMode(enum.Enum):
    """torchvision.transforms.InterpolationMode's members (read at import by transformers)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _unavailable(what: str) -> RuntimeError:
    return RuntimeError(
        f"{what}: torchvision is an import-only stand-in here (tests/sglang/shims/torchvision.py)"
    )


class _StandInClass(type):
    """The metaclass of stand-in classes: calling one or reading its attributes raises."""

    def __call__(cls, *args, **kwargs):
        raise _unavailable(f"{cls.__module__}.{cls.__qualname__}")

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise _unavailable(f"{cls.__module__}.{cls.__qualname__}.{name}")

    def __getitem__(cls, item):
        # Subscripts in annotations (``Foo[int]``) are evaluated at import.
        return cls


class _StandInModule(types.ModuleType):
    """A stand-in (sub)module; calling it (it may stand for a function) raises."""

    def __call__(self, *args, **kwargs):
        raise _unavailable(self.__name__)

    def __getattr__(self, name):
        value = _attribute(self.__name__, name)
        setattr(self, name, value)
        return value


def _attribute(module: str, name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    if name == "InterpolationMode":
        return InterpolationMode
    if name[:1].islower():
        # A submodule (``transforms``, ``functional``, ``io``) or a function.
        return importlib.import_module(f"{module}.{name}")
    return _StandInClass(name, (), {"__qualname__": name, "__module__": module})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def __getattr__(name):
    return _attribute(__name__, name)


__path__: list[str] = []
sys.meta_path.insert(0, _Finder())
