"""Secrets: the workers' shared token and the clients' API key. Never on a command line (any local
user reads those with `ps`): from a file, or from the environment.

- `read_secret`: a file named by a flag (`--token-file`, `--api-key-file`), else an environment
  variable (PDSERVE_TOKEN, PDSERVE_API_KEY).
- `new_token_file`: a server started without a token on a loopback address makes one, in a file
  only its user can read, and says where; internal routes never run open.
- `is_loopback`: any other address needs a token given explicitly, since peers on other hosts
  must be handed the same one.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import stat
import sys
from pathlib import Path

TOKEN_ENV = "PDSERVE_TOKEN"
API_KEY_ENV = "PDSERVE_API_KEY"
ADMIN_KEY_ENV = "PDSERVE_ADMIN_KEY"
MAX_SECRET_BYTES = 4096


def read_secret(path: str | None, env_var: str) -> str:
    """The secret in `path` (first line, stripped) if given, else in the environment ("" if none)."""
    if not path:
        return os.environ.get(env_var, "").strip()
    file = Path(path)
    try:
        if file.stat().st_size > MAX_SECRET_BYTES:
            raise ValueError(f"{path} is not a secret file (over {MAX_SECRET_BYTES} bytes)")
        text = file.read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read the secret file {path}: {e.strerror}") from None
    if not text:
        raise ValueError(f"the secret file {path} is empty")
    if file.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        print(f"pdserve: warning: {path} can be read by other users; chmod 600 it", file=sys.stderr)
    return text.splitlines()[0].strip()


def secrets_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or str(Path.home() / ".cache")
    directory = Path(base) / "pdserve"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return directory


def new_token_file(name: str) -> tuple[str, Path]:
    """A fresh token, written to <secrets dir>/<name>.token, readable by this user only."""
    token = secrets.token_hex(32)
    path = secrets_dir() / f"{name}.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an older file of the same name may have had looser rights
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)
    return token, path


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _NoSecretOnCommandLine(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} would put a secret on the command line, where every local user can read "
                     f"it; use {option_string}-file PATH or the {self.const} environment variable")


def add_secret_args(group, name: str, env_var: str, what: str) -> None:
    """`--<name>-file PATH`, and `--<name>` refused with a message saying why and what to use."""
    group.add_argument(f"--{name}-file", default=None, metavar="PATH",
                       help=f"file holding {what} (default: the {env_var} environment variable)")
    group.add_argument(f"--{name}", action=_NoSecretOnCommandLine, const=env_var, help=argparse.SUPPRESS)
