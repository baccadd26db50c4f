"""The P:D controller's flags: `pdserve router` builds its policy from them, `pdserve serve` hands
them to its router unchanged, and a value that is not a positive time is refused by argparse."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.router.main import build_router, controller_argv
from pdserve.router.rebalance import RebalancePolicy

FLAGS = ["--rebalance", "--rebalance-confirm-s", "2.5", "--rebalance-dwell-s", "7", "--slo-ttft-ms", "4000",
         "--slo-tpot-ms", "80"]


def test_serve_hands_the_controller_flags_to_a_router_that_builds_its_policy_from_them(tiny_llama):
    serve = build_parser().parse_args(["serve", *FLAGS])
    router_args = build_parser().parse_args(["router", "--model", str(tiny_llama), *controller_argv(serve)])
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
