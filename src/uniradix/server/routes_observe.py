"""What an operator and a gateway look at: `/metrics` (Prometheus), `/dashboard` and its
data, `/cache/tree` (the tree's shape) and `/v1/loads` (SGLang's load report, which
SGLang's gateway routes by). Each reads the engine on the scheduler thread, between two
steps."""
from __future__ import annotations

from fastapi.responses import HTMLResponse, Response

from . import dashboard
from .loads import scheduler_loads
from .metrics import CONTENT_TYPE
from .offload import json_answer
from .protocol import want
from .query import query_int


def add_routes(app, jobs, metrics, version: str) -> None:
    runner, engine, model_name = jobs.runner, jobs.engine, app.state.model_name

    @app.get("/metrics")
    async def metrics_route():
        # one moment of the scheduler thread: counters and gauges agree. Rendered on the
        # loop: its size is the series', bounded whatever is asked, and render() is not
        # re-entrant (the snapshot it collects from is handed over on the instance)
        return Response(metrics.render(await runner.run(runner.snapshot)), media_type=CONTENT_TYPE)

    @app.get("/dashboard")
    async def dashboard_page():
        return HTMLResponse(dashboard.page(), headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/data")
    async def dashboard_data():
        info = {"model": model_name, "version": version, "started": app.state.started}
        return await json_answer(await runner.run(
            lambda: dashboard.dashboard_data(metrics.values(runner.snapshot()), runner.history, engine, info)))

    @app.get("/cache/tree")
    async def cache_tree(depth: str | None = None, children: str | None = None):
        """The tree's shape, read between two steps: `depth` levels below each root (0 to
        64, default 4), at most `children` children a node (1 to 1024, default 32), the
        longest spans first."""
        from ..tree.shape import tree_shape
        levels = query_int("depth", depth, 4, 0, 64)
        most = query_int("children", children, 32, 1, 1024)
        tree = engine.cache.tree
        return await json_answer(await runner.run(lambda: tree_shape(tree, levels, most)))

    @app.get("/v1/loads")
    async def v1_loads(include: str = "all", dp_rank: str | None = None):
        """SGLang's load report (loads.py). `include`: SGLang's section names, comma-
        separated; the core figures come whatever is named (a name this server does not
        know is no error: a gateway that gets none gives up on the report for good);
        `dp_rank`: 0, the only one."""
        want(dp_rank is None or dp_rank == "0", "dp_rank", "0 (this server has one data-parallel rank)", dp_rank)
        return await runner.run(lambda: scheduler_loads(engine, runner.history, version))
