"""docs/api.md is what ``python tools/apidoc.py`` renders from the worker's and the router's
OpenAPI schemas now: a route, a field or a bound changed in code fails here until the page is
regenerated."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import apidoc

API_MD = Path(__file__).resolve().parents[1] / "docs" / "api.md"


@pytest.fixture(scope="module")
def services() -> list[apidoc.Service]:
    return apidoc.build_services()


@pytest.fixture(scope="module")
def rendered(services: list[apidoc.Service]) -> str:
    return apidoc.render(services)


def test_docs_api_md_is_current(rendered: str) -> None:
    on_disk = API_MD.read_text(encoding="utf-8") if API_MD.exists() else ""
    assert on_disk == rendered, (
        f"docs/api.md is out of date with the OpenAPI schemas; regenerate it with "
        f"`{apidoc.REGENERATE}`"
    )


def test_every_route_of_worker_and_router_has_a_section(
    services: list[apidoc.Service], rendered: str
) -> None:
    worker, router, dashboard = services
    for service in (worker, router):
        operations = list(service.operations())
        assert operations
        for method, path, _ in operations:
            assert f"### `{method} {path}`" in rendered
    assert "### `POST /v1/completions`" in rendered
    assert "### `PUT /policy`" in rendered
    # The standalone dashboard serves the router's read-only routes, none of the routing ones.
    dashboard_routes = {(m, p) for m, p, _ in dashboard.operations()}
    assert ("POST", "/route") not in dashboard_routes
    assert dashboard_routes < {(m, p) for m, p, _ in router.operations()}


def test_request_fields_show_type_requiredness_and_bounds(rendered: str) -> None:
    assert "| `max_tokens` | integer | no | `16` | ≥ 1 | tokens to generate |" in rendered
    assert "| `block_hashes` | array of integer | yes |  | items ≥ 1, items ≤ 65536 |  |" in (
        rendered
    )
    assert "Admin: needs `Authorization: Bearer <KVMESH_ADMIN_TOKEN>`." in rendered


def test_the_output_does_not_depend_on_the_environment(
    rendered: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker setting that would not even validate without a block count.
    monkeypatch.setenv("KVMESH_MODEL", "llama-3-70b")
    monkeypatch.setenv("KVMESH_WORKER_ID", "elsewhere")
    assert apidoc.render() == rendered


def test_check_exits_1_naming_the_command_when_the_file_differs(
    tmp_path: Path, rendered: str, capsys: pytest.CaptureFixture[str]
) -> None:
    current = tmp_path / "api.md"
    current.write_text(rendered, encoding="utf-8")
    assert apidoc.main(["--check", str(current)]) == 0
    stale = tmp_path / "stale.md"
    stale.write_text(rendered.replace("Liveness", "Alive?"), encoding="utf-8")
    assert apidoc.main(["--check", str(stale)]) == 1
    err = capsys.readouterr().err
    assert apidoc.REGENERATE in err
    assert "-Alive?." in err and "+Liveness." in err
    assert apidoc.main(["--check", str(tmp_path / "missing.md")]) == 1
