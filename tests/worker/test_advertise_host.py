"""`--advertise-host`: a worker bound to every address (a pod: `--host 0.0.0.0`) tells the router
and its peers an address they can reach (the pod's IP), for its control endpoint and its KV port."""

from __future__ import annotations

import httpx
import pytest

from pdserve.cli import build_parser
from pdserve.worker.main import worker_url
from tests.worker.processes import spawn


def test_the_advertised_address_defaults_to_the_bound_one():
    args = build_parser().parse_args(["worker", "--host", "10.0.0.7"])
    assert args.advertise_host is None
    args = build_parser().parse_args(["worker", "--host", "0.0.0.0", "--advertise-host", "10.0.0.7"])
    assert (args.host, args.advertise_host) == ("0.0.0.0", "10.0.0.7")


@pytest.mark.parametrize("bad", ["", "evil.example/path", "user@host", "host name", "h" * 254])
def test_an_advertised_address_that_is_not_a_host_is_refused(bad, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["worker", "--advertise-host", bad])
    assert e.value.code == 2 and "--advertise-host" in capsys.readouterr().err


def test_an_ipv6_address_is_bracketed_in_the_url():
    assert worker_url("10.0.0.7", 8100) == "http://10.0.0.7:8100"
    assert worker_url("fd00::7", 8100) == "http://[fd00::7]:8100"


def test_a_worker_on_every_address_advertises_the_one_given(tiny_llama):
    proc, ready = spawn(tiny_llama, "decode", "--host", "0.0.0.0", "--advertise-host", "127.0.0.1",
                        "--transfer", "tcp")
    try:
        assert ready["url"].startswith("http://127.0.0.1:")  # what it registers with the router
        assert ready["kv"]["tcp"]["host"] == "127.0.0.1"  # what prefill workers connect to
        assert httpx.get(ready["url"] + "/health", timeout=10).status_code == 200
    finally:
        proc.kill()
        proc.wait(10)
