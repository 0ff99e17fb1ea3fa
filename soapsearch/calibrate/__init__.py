"""Simulator fidelity: calibrate a topology from measurements of this machine's processes, and
compare a plan's simulated iteration with the executor's measured one."""

from soapsearch.calibrate.compare import CompareResult, Measured, compare, run_plans
from soapsearch.calibrate.fit import OverheadFit, build_topology, fit_alpha_beta, fit_overheads, spearman
from soapsearch.calibrate.measure import Calibration, calibrate, measure

__all__ = ["Calibration", "CompareResult", "Measured", "OverheadFit", "build_topology", "calibrate", "compare",
           "fit_alpha_beta", "fit_overheads", "measure", "run_plans", "spearman"]
