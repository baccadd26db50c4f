"""The P:D controller's flags: `pdserve router` builds its policy from them, `pdserve serve` hands
them to its router unchanged, and a value that is not a positive time is refused by argparse."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.launcher import router_argv
from pdserve.router.main import build_router
from pdserve.router.rebalance import RebalancePolicy

FLAGS = ["--rebalance", "--rebalance-confirm-s", "2.5", "--rebalance-dwell-s", "7", "--slo-ttft-ms", "4000",
         "--slo-tpot-ms", "80"]


def test_serve_hands_the_controller_flags_to_a_router_that_builds_its_policy_from_them(tiny_llama):
    serve = build_parser().parse_args(["serve", *FLAGS])
    router_args = build_parser().parse_args([*router_argv(serve, "127.0.0.1", 0), "--model", str(tiny_llama)])
    policy = build_router(router_args).config.rebalance
    assert policy == RebalancePolicy(ttft_target_s=4.0, tpot_target_s=0.08, confirm_s=2.5, dwell_s=7.0)
    assert build_router(build_parser().parse_args(["router", "--model", str(tiny_llama)])).config.rebalance is None


def test_the_defaults_are_the_policy_defaults():
    args = build_parser().parse_args(["serve", "--rebalance"])
    assert (args.rebalance_confirm_s, args.rebalance_dwell_s) == (RebalancePolicy().confirm_s, RebalancePolicy().dwell_s)


@pytest.mark.parametrize("command", ["serve", "router"])
@pytest.mark.parametrize("flag", ["--rebalance-confirm-s", "--rebalance-dwell-s", "--slo-ttft-ms", "--slo-tpot-ms"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_time_that_is_not_positive_is_an_argparse_error(command, flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([command, flag, value])
    assert e.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--prefix-affinity", "1.5"), ("--prefix-affinity", "-0.1"),
                                         ("--prefix-affinity", "nan"), ("--hot-prefix-rate", "-1"),
                                         ("--hot-prefix-rate", "inf"), ("--hot-prefix-rate", "nan"),
                                         ("--hot-prefix-rate", "often")])
def test_hot_prefix_flags_out_of_bounds_are_argparse_errors(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["router", flag, value])
    assert e.value.code == 2 and flag in capsys.readouterr().err


# A value other than the default for each router flag, as the config holds it.
CHANGED = {"max_tokens_default": 64, "lease_s": 2.5, "max_queued_requests": 8, "queue_timeout_s": 12.0,
           "migrate_on_failure": True, "resume_wait_s": 4.5, "migrate_hot_spots": False, "hot_kv_usage": 0.5,
           "prefix_affinity": 0.0, "hot_prefix_rate": 0.5, "controller": True,
           "rebalance_confirm_s": 2.5, "rebalance_dwell_s": 7.0, "slo_ttft_ms": 4000.0, "slo_tpot_ms": 80.0,
           "tool_call_parser": "mistral", "otlp_traces_endpoint": "http://127.0.0.1:4318",
           "stable_version": "v1"}


def test_every_router_flag_reaches_the_router_serve_starts(tiny_llama):
    from pdserve.flags import config_argv, options
    from pdserve.router.config import RouterConfig

    assert {o.field for o in options(RouterConfig)} == set(CHANGED)
    given = RouterConfig("m", 64, **CHANGED)
    serve = build_parser().parse_args(["serve", *config_argv(given)])
    config = build_router(build_parser().parse_args([*router_argv(serve, "127.0.0.1", 0), "--model", str(tiny_llama)])
                          ).config
    assert {k: getattr(config, k) for k in CHANGED} == CHANGED
    assert (config.decode_weights.hot_kv_usage, config.rebalance.hot_kv_usage) == (0.5, 0.5)


@pytest.mark.parametrize("field, value", [("lease_s", 0.0), ("hot_kv_usage", 1.5), ("max_queued_requests", 0),
                                          ("slo_ttft_ms", -1.0)])
def test_a_library_caller_is_refused_what_the_flag_refuses(field, value):
    from pdserve.router.config import RouterConfig

    with pytest.raises(ValueError, match=field):
        RouterConfig("m", 64, **{field: value})
