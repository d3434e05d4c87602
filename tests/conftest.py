"""pytest hooks only; the helpers tests use live in harness.py."""

from __future__ import annotations

import sys


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Print the parity table (layout -> measured errors) when the parity tests ran."""
    table = getattr(sys.modules.get("test_parity"), "PARITY_TABLE", None)
    if not table:
        return
    terminalreporter.section("parity vs single-process fp32 (bound: loss rel 1e-5, params abs 1e-5)")
    terminalreporter.write_line(f"{'layout':50s} {'max rel loss err':>18s} {'max abs param err':>18s}")
    for name, (loss_err, param_err) in table.items():
        terminalreporter.write_line(f"{name:50s} {loss_err:18.2e} {param_err:18.2e}")
    planner = getattr(sys.modules.get("test_parity"), "PLANNER_TABLE", None)
    if planner:
        terminalreporter.section("planner persistent bytes vs measured (bound: 10%)")
        terminalreporter.write_line(f"{'layout':50s} {'worst |est/meas - 1|':>20s} {'measured B/rank':>16s}")
        for name, (worst, measured) in planner.items():
            terminalreporter.write_line(f"{name:50s} {worst:20.2%} {measured:16.0f}")
    fit = getattr(sys.modules.get("test_parity"), "FIT_TABLE", None)
    if fit:
        terminalreporter.section(
            "cuboid.planning.capacity parameter bytes estimated before sharding vs measured (bound: 10%)"
        )
        for name, worst in fit.items():
            terminalreporter.write_line(f"{name:50s} {worst:20.2%}")
