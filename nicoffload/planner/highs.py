"""HiGHS as `scipy.optimize.milp` calls it, without milp's Python work around each call.

milp validates and converts its arguments on every call (the constraint matrix to CSC, the
integrality to a list of HiGHS types) and, after HiGHS, reads every column's basis status in a
Python loop for the bounds' multipliers the planner never reads: about 25 ms a call on a flow
problem of 10,000 columns, a quarter of the 50-node bench's search. `Program.run` hands HiGHS the same
model with the same options through scipy's bundled HiGHS module (`scipy.optimize._highspy`,
scipy >= 1.15), so HiGHS takes the same steps and returns the same solution, and reads back only
what milp's result holds; without that module it calls milp.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

try:  # scipy's own HiGHS binding: private, so anything amiss falls back to milp
    from scipy.optimize._highspy import _core
    from scipy.optimize._linprog_highs import _highs_to_scipy_status_message

    _core.HighsLp, _core._Highs, _core.HighsOptions, _core.HighsVarType  # noqa: B018
except (ImportError, AttributeError):  # pragma: no cover - older scipy
    _core = None

_MILP_OPTIONS = ("disp", "presolve", "time_limit", "node_limit", "mip_rel_gap")  # milp takes
_TYPES: dict[bytes, list] = {}  # integrality (as uint8 bytes) -> HiGHS's variable types


class Program:
    """The rows of a program (lo <= A x <= hi) for many runs that vary the objective, the
    columns' bounds and integrality: HiGHS's copy of the matrix is made once (setting it took
    8-9 ms of a run on a flow problem of 10,000 columns)."""

    def __init__(self, A, lo, hi) -> None:
        from scipy.sparse import csc_array

        self.A = csc_array(A)  # as milp hands it to HiGHS
        self.lo = np.atleast_1d(lo).astype(np.float64)
        self.hi = np.atleast_1d(hi).astype(np.float64)
        self._lp = None

    def run(self, c, lb, ub, integrality, options: dict):
        """milp(c, constraints=[LinearConstraint(A, lo, hi)], integrality, bounds=Bounds(lb,
        ub), options): the same result's status, message, x, fun, mip_node_count,
        mip_dual_bound and mip_gap. The fallback passes milp only the options it takes
        (_MILP_OPTIONS): HiGHS's others are then left at their defaults."""
        c = np.asarray(c, np.float64)
        integrality = np.broadcast_to(integrality, c.shape).astype(np.uint8)
        lb = np.broadcast_to(lb, c.shape).astype(np.float64)
        ub = np.broadcast_to(ub, c.shape).astype(np.float64)
        if _core is None:  # pragma: no cover - older scipy
            from scipy.optimize import Bounds, LinearConstraint, milp

            return milp(
                c,
                constraints=[LinearConstraint(self.A, self.lo, self.hi)],
                integrality=integrality,
                bounds=Bounds(lb, ub),
                options={k: v for k, v in options.items() if k in _MILP_OPTIONS},
            )
        lp = self._model()
        lp.col_cost_ = c.tolist()  # lists: pybind copies them twice as fast as arrays
        lp.col_lower_ = lb.tolist()
        lp.col_upper_ = ub.tolist()
        key = integrality.tobytes()
        types = _TYPES.get(key)
        if types is None:
            if len(_TYPES) > 64:
                _TYPES.clear()
            types = _TYPES[key] = [_core.HighsVarType(int(i)) for i in integrality]
        lp.integrality_ = types
        return _run(lp, bool(integrality.sum() > 0), options)

    def _model(self):
        if self._lp is None:
            h, A = _core, self.A
            lp = self._lp = h.HighsLp()
            n, m = A.shape[1], self.hi.size
            lp.num_col_ = n
            lp.num_row_ = m
            lp.a_matrix_.num_col_ = n
            lp.a_matrix_.num_row_ = m
            lp.a_matrix_.format_ = h.MatrixFormat.kColwise
            lp.row_lower_ = self.lo.tolist()
            lp.row_upper_ = self.hi.tolist()
            lp.a_matrix_.start_ = A.indptr.tolist()
            lp.a_matrix_.index_ = A.indices.tolist()
            lp.a_matrix_.value_ = A.data.astype(np.float64).tolist()
        return self._lp


def _run(lp, is_mip: bool, options: dict):
    """scipy's _highs_wrapper and milp's reading of its result, less what nothing here reads."""
    h = _core
    highs = h._Highs()
    opts = h.HighsOptions()
    settings = {"log_to_console": options.get("disp", False)}
    if options.get("node_limit") is not None:
        settings["mip_max_nodes"] = options["node_limit"]
    settings.update({k: v for k, v in options.items() if k not in ("disp", "node_limit")})
    for key, val in settings.items():
        if val is None:
            continue
        if key in ("presolve", "parallel") and isinstance(val, bool):
            val = "on" if val else "off"
        setattr(opts, key, val)
    out = SimpleNamespace(x=None, fun=None, mip_node_count=None, mip_dual_bound=None)
    out.mip_gap = None
    if highs.passOptions(opts) == h.HighsStatus.kError:
        return _status(out, highs.getModelStatus(), None, highs)
    if highs.passModel(lp) == h.HighsStatus.kError:
        return _status(out, h.HighsModelStatus.kModelError, None, highs)
    if highs.run() == h.HighsStatus.kError:
        return _status(out, highs.getModelStatus(), None, highs)
    model_status = highs.getModelStatus()
    info = highs.getInfo()
    limits = (
        h.HighsModelStatus.kTimeLimit,
        h.HighsModelStatus.kIterationLimit,
        h.HighsModelStatus.kSolutionLimit,
    )
    mip_fail = model_status not in (h.HighsModelStatus.kOptimal, *limits) or (
        model_status in limits and info.objective_function_value == h.kHighsInf
    )
    lp_fail = model_status != h.HighsModelStatus.kOptimal
    if (is_mip and mip_fail) or (not is_mip and lp_fail):
        message = (
            f"model_status is {highs.modelStatusToString(model_status)}; primal_status is "
            f"{highs.solutionStatusToString(info.primal_solution_status)}"
        )
        return _status(out, model_status, message, highs)
    out.x = np.array(highs.getSolution().col_value)
    out.fun = info.objective_function_value
    if is_mip:
        out.mip_node_count = info.mip_node_count
        out.mip_dual_bound = info.mip_dual_bound
        out.mip_gap = info.mip_gap
    return _status(out, model_status, None, highs)


def _status(out, model_status, message, highs):
    if message is None:
        message = highs.modelStatusToString(model_status)
    out.status, out.message = _highs_to_scipy_status_message(model_status, message)
    out.success = out.status == 0
    return out
