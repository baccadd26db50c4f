"""Every call into a deserializer that can run code (pickle in each of its forms, marshal,
torch.load), seen where it runs rather than by name, so that an alias taken before the guard was
armed, a subclass or a C entry point is caught as surely as `pickle.loads`.

Two watchers, both recording (never raising: a worker thread would swallow the exception and
fall back quietly):
- a profile function, in the arming thread and in every thread started while armed: a call to
  one of the C deserializers (`_pickle.loads/load`, `Unpickler.load`, `marshal.loads/load`) or to
  one of the pure-Python ones (`pickle._Unpickler.load`, `torch.load`, torch's weights-only
  unpickler). It sees what runs, however it was reached.
- an audit hook, in every thread, also those started before the guard: CPython raises
  `pickle.find_class` whenever an unpickler resolves a global (any pickle of an object, a class
  or a `copyreg` reconstructor) and `marshal.loads` / `marshal.load` for every marshal read. An
  audit hook cannot be removed: it is added once and does nothing while no guard is armed.
"""

from __future__ import annotations

import _pickle
import marshal
import pickle
import sys
import threading

import torch
import torch._weights_only_unpickler as weights_only

_C_FUNCTIONS = ((_pickle.loads, "_pickle.loads"), (_pickle.load, "_pickle.load"),
                (marshal.loads, "marshal.loads"), (marshal.load, "marshal.load"))
_PY_FUNCTIONS = {
    pickle._Unpickler.load.__code__: "pickle._Unpickler.load",
    pickle._loads.__code__: "pickle._loads",
    pickle._load.__code__: "pickle._load",
    torch.load.__code__: "torch.load",
    weights_only.Unpickler.load.__code__: "torch weights-only Unpickler.load",
    weights_only.load.__code__: "torch weights-only load",
}
_AUDIT_EVENTS = {"pickle.find_class", "marshal.loads", "marshal.load"}

_armed: list[DeserializerGuard] = []  # the guards armed now (the audit hook's only state)
_audit_hook_added = False


def _importing(frame) -> bool:
    """Python's import system reads a module's cached bytecode with marshal: that is code from
    the local disk, not from the wire."""
    return frame is not None and frame.f_code.co_name == "_compile_bytecode"


def _audit(event: str, args: tuple) -> None:
    if event in _AUDIT_EVENTS and _armed:
        if event.startswith("marshal.") and _importing(sys._getframe(1)):
            return
        for guard in _armed:
            guard.calls.append(f"{event}{args!r}")


class DeserializerGuard:
    """`with DeserializerGuard() as guard: ...` then `assert guard.calls == []`."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _profile(self, frame, event: str, arg) -> None:
        if event == "c_call":
            # by identity: a builtin method hashes its owner, which may be unhashable
            name = next((n for f, n in _C_FUNCTIONS if arg is f), None)
            if name is None and isinstance(getattr(arg, "__self__", None), _pickle.Unpickler):
                name = f"{type(arg.__self__).__name__}.{arg.__name__}"  # also a subclass's load
            if name is not None and not (name.startswith("marshal.") and _importing(frame)):
                self.calls.append(f"{name} in {threading.current_thread().name}")
        elif event == "call":
            name = _PY_FUNCTIONS.get(frame.f_code)
            if name is not None:
                self.calls.append(f"{name} in {threading.current_thread().name}")

    def __enter__(self) -> DeserializerGuard:
        global _audit_hook_added
        if not _audit_hook_added:
            sys.addaudithook(_audit)
            _audit_hook_added = True
        _armed.append(self)
        sys.setprofile(self._profile)
        threading.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # threads started meanwhile keep it: they record into `calls` still
        _armed.remove(self)
