"""The HTTP API reference (``docs/api.md``), rendered from the services' own OpenAPI schemas.

``python tools/apidoc.py`` prints the Markdown; ``python tools/apidoc.py --check docs/api.md``
exits 1, naming the command that regenerates it, when the file differs from what the schemas
give now (``tests/test_api_docs.py`` runs that comparison, so the page cannot drift).

The schemas come from ``create_app`` of the worker and of the router, which builds the routes
and connects to nothing until its lifespan runs. The settings they are built with read no
environment (``_isolated``), so a ``KVMESH_``
variable set in the shell cannot change the page. The output depends only on the code:
paths in the order the services declare them, statuses sorted, models sorted by name.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from app.core.settings import Settings
from app.dashboard.settings import DashboardSettings
from app.router.settings import RouterSettings
from app.worker.settings import WorkerSettings

__all__ = ["REGENERATE", "Service", "build_services", "main", "render"]

REGENERATE = ".venv/bin/python tools/apidoc.py > docs/api.md"
_METHODS = ("get", "put", "post", "delete", "patch", "head", "options")
_MAX_U64_FLOAT = float((1 << 64) - 1)
_CONSTRAINTS = (
    ("minimum", "≥ {}"),
    ("exclusiveMinimum", "> {}"),
    ("maximum", "≤ {}"),
    ("exclusiveMaximum", "< {}"),
    ("minLength", "length ≥ {}"),
    ("maxLength", "length ≤ {}"),
    ("minItems", "items ≥ {}"),
    ("maxItems", "items ≤ {}"),
    ("pattern", "matches `{}`"),
)


S = TypeVar("S", bound=Settings)


def _isolated(model: type[S]) -> type[S]:
    """``model`` built from its arguments and defaults only (no ``KVMESH_`` variables)."""

    class Isolated(model):  # type: ignore[valid-type,misc]
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings,)

    return Isolated


class Service:
    """One service's OpenAPI schema, and the name its section and anchors go by."""

    def __init__(self, slug: str, command: str, schema: Mapping[str, Any]) -> None:
        self.slug = slug
        self.command = command
        self.schema = schema

    @property
    def models(self) -> Mapping[str, Any]:
        components: Mapping[str, Any] = self.schema.get("components", {})
        schemas: Mapping[str, Any] = components.get("schemas", {})
        return schemas

    def operations(self) -> Iterator[tuple[str, str, Mapping[str, Any]]]:
        """(METHOD, path, operation) in the order the service declares its routes."""
        for path, item in self.schema.get("paths", {}).items():
            for method in _METHODS:
                if method in item:
                    yield method.upper(), path, item[method]


def build_services() -> list[Service]:
    """The worker's, the router's and the standalone dashboard's schemas (no I/O)."""
    from app.services import dashboard_app, router_app
    from app.worker.app import create_app as create_worker_app

    unused = {"redis_url": "redis://unused"}
    worker = create_worker_app(
        _isolated(WorkerSettings).model_validate({"worker_id": "w0"})
    ).openapi()
    router = router_app(_isolated(RouterSettings).model_validate(unused)).openapi()
    dashboard = dashboard_app(_isolated(DashboardSettings).model_validate(unused)).openapi()
    return [
        Service("worker", "kvmesh worker", worker),
        Service("router", "kvmesh router", router),
        Service("dashboard", "kvmesh dashboard", dashboard),
    ]


# -- rendering pieces ----------------------------------------------------------------------------


def _cell(text: object) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _number(value: object) -> str:
    if isinstance(value, float):
        if value == _MAX_U64_FLOAT:
            return "2^64 - 1"
        if value.is_integer() and abs(value) < 2**53:
            return str(int(value))
    return str(value)


def _anchor(service: Service, model: str) -> str:
    return f"{service.slug}-{model.lower()}"


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _type(schema: Mapping[str, Any], service: Service) -> str:
    """A JSON schema as a short type expression; models link to their table."""
    if "$ref" in schema:
        name = _ref_name(schema["$ref"])
        return f"[{name}](#{_anchor(service, name)})"
    for combinator in ("anyOf", "oneOf"):
        if combinator in schema:
            return " or ".join(_type(branch, service) for branch in schema[combinator])
    if "allOf" in schema:
        return " and ".join(_type(branch, service) for branch in schema["allOf"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return " or ".join(f"`{json.dumps(value)}`" for value in schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array":
        items = schema.get("items")
        return f"array of {_type(items, service)}" if items else "array"
    if kind == "object":
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping) and extra:
            return f"object of {_type(extra, service)}"
        return "object"
    return str(kind) if kind else "any"


def _constraints(schema: Mapping[str, Any]) -> str:
    """Bounds of a value, from the schema and from the non-null branches of an ``anyOf``."""
    found: list[str] = []
    parts = [schema, *schema.get("anyOf", ()), *schema.get("oneOf", ())]
    for part in parts:
        for key, template in _CONSTRAINTS:
            if key in part:
                text = template.format(_number(part[key]))
                if text not in found:
                    found.append(text)
    return ", ".join(found)


def _default(schema: Mapping[str, Any]) -> str:
    if "default" not in schema:
        return ""
    return f"`{json.dumps(schema['default'], sort_keys=True)}`"


def _fields_table(model: Mapping[str, Any], service: Service) -> list[str]:
    properties: Mapping[str, Any] = model.get("properties", {})
    if not properties:
        extra = model.get("additionalProperties")
        if extra:
            return [
                "Any JSON object" + (f" of {_type(extra, service)}" if extra is not True else "")
            ]
        return ["No fields."]
    required = set(model.get("required", ()))
    lines = [
        "| field | type | required | default | constraints | description |",
        "|---|---|---|---|---|---|",
    ]
    for name, prop in properties.items():
        lines.append(
            "| "
            + " | ".join(
                (
                    f"`{name}`",
                    _cell(_type(prop, service)),
                    "yes" if name in required else "no",
                    _cell(_default(prop)),
                    _cell(_constraints(prop)),
                    _cell(prop.get("description", "")),
                )
            )
            + " |"
        )
    if model.get("additionalProperties") is True:
        lines += ["", "Other fields are accepted."]
    return lines


def _parameters(operation: Mapping[str, Any], service: Service) -> list[str]:
    params = [p for p in operation.get("parameters", ()) if p.get("name") != "authorization"]
    if not params:
        return []
    lines = [
        "Parameters:",
        "",
        "| name | in | type | required | default | constraints | description |",
        "|---|---|---|---|---|---|---|",
    ]
    for param in params:
        schema = param.get("schema", {})
        lines.append(
            "| "
            + " | ".join(
                (
                    f"`{param['name']}`",
                    param.get("in", ""),
                    _cell(_type(schema, service)),
                    "yes" if param.get("required") else "no",
                    _cell(_default(schema)),
                    _cell(_constraints(schema)),
                    _cell(param.get("description", schema.get("description", ""))),
                )
            )
            + " |"
        )
    return [*lines, ""]


def _request_body(operation: Mapping[str, Any], service: Service) -> list[str]:
    body = operation.get("requestBody")
    if not body:
        return []
    lines: list[str] = []
    for media, content in sorted(body.get("content", {}).items()):
        schema = content.get("schema", {})
        required = "required" if body.get("required") else "optional"
        lines += [f"Request body ({required}, `{media}`): {_type(schema, service)}", ""]
        if "$ref" in schema:
            lines += [*_fields_table(service.models[_ref_name(schema["$ref"])], service), ""]
    return lines


def _responses(operation: Mapping[str, Any], service: Service) -> list[str]:
    lines = ["Responses:", "", "| status | description | body |", "|---|---|---|"]
    responses: Mapping[str, Any] = operation.get("responses", {})
    for status in sorted(responses):
        response = responses[status]
        description = response.get("description", "")
        if status == "422":
            description += " (answered with 400, see the top of the page)"
        bodies = [
            f"{_type(content.get('schema', {}), service)} (`{media}`)"
            if media != "application/json"
            else _type(content.get("schema", {}), service)
            for media, content in sorted(response.get("content", {}).items())
        ]
        body_text = ", ".join(bodies) if bodies else ""
        lines.append(f"| {status} | {_cell(description)} | {_cell(body_text)} |")
    return lines


def _referenced_models(service: Service) -> list[str]:
    """Every model an operation refers to, directly or through another model, by name."""
    seen: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, Mapping):
            ref = node.get("$ref")
            if isinstance(ref, str):
                name = _ref_name(ref)
                if name not in seen:
                    seen.add(name)
                    walk(service.models.get(name, {}))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for _, _, operation in service.operations():
        walk(operation)
    return sorted(seen)


def _is_admin(operation: Mapping[str, Any]) -> bool:
    return any(
        p.get("name") == "authorization" and p.get("in") == "header"
        for p in operation.get("parameters", ())
    )


def _operation(method: str, path: str, operation: Mapping[str, Any], service: Service) -> list[str]:
    anchor = _operation_anchor(service, method, path)
    lines = [f'<a id="{anchor}"></a>', "", f"### `{method} {path}`", ""]
    summary = operation.get("summary")
    if summary:
        lines += [summary if summary.endswith(".") else f"{summary}.", ""]
    description = operation.get("description")
    if description:
        lines += [" ".join(description.split()), ""]
    if _is_admin(operation):
        lines += ["Admin: needs `Authorization: Bearer <KVMESH_ADMIN_TOKEN>`.", ""]
    lines += _parameters(operation, service)
    lines += _request_body(operation, service)
    lines += _responses(operation, service)
    return [*lines, ""]


def _overview(service: Service, *, link: bool = True) -> list[str]:
    lines = ["| route | summary |", "|---|---|"]
    for method, path, operation in service.operations():
        name = f"`{method} {path}`"
        if link:
            name = f"[{name}](#{_operation_anchor(service, method, path)})"
        lines.append(f"| {name} | {_cell(operation.get('summary', ''))} |")
    return lines


def _operation_anchor(service: Service, method: str, path: str) -> str:
    """An explicit anchor per operation: both services have ``GET /health``, so GitHub's own
    heading anchors would collide."""
    words = "".join(c if c.isalnum() else " " for c in f"{method} {path}".lower()).split()
    return "-".join([service.slug, *words])


def _service_section(service: Service) -> list[str]:
    info: Mapping[str, Any] = service.schema.get("info", {})
    lines = [f"## `{service.command}`", ""]
    if info.get("summary"):
        lines += [f"{info['summary']}.", ""]
    lines += [*_overview(service), ""]
    for method, path, operation in service.operations():
        lines += _operation(method, path, operation, service)
    lines += [f"### Models of `{service.command}`", ""]
    for name in _referenced_models(service):
        model = service.models.get(name, {})
        lines += [f'<a id="{_anchor(service, name)}"></a>', "", f"#### `{name}`", ""]
        if model.get("description"):
            lines += [" ".join(model["description"].split()), ""]
        lines += [*_fields_table(model, service), ""]
    return lines


_PREAMBLE = f"""\
<!-- Generated by `python tools/apidoc.py` from the services' OpenAPI schemas: do not edit.
     Regenerate with `{REGENERATE}`; tests/test_api_docs.py checks it. -->

# HTTP API reference

Every route of `kvmesh worker` and `kvmesh router` (and the read-only subset that
`kvmesh dashboard` serves), with its request fields, their bounds and its responses, rendered
from the services' own OpenAPI schemas. A running service serves the same schema at
`/openapi.json` and an interactive page at `/docs`.

- Errors have OpenAI's shape, `{{"error": {{"message", "type", "param", "code"}}}}`, and the
  message names what was wrong. FastAPI's schemas list 422 for a request the schema refuses;
  both services answer it with 400 (`app/core/http.py`).
- Admin routes need `Authorization: Bearer <KVMESH_ADMIN_TOKEN>`: 401 without it, 403 with a
  wrong one, and 403 for everyone when the service has no token. Reads need no token.
- The worker's behaviour behind these routes is in [worker.md](worker.md); the router's
  policies in [routing.md](routing.md). The dashboard page itself is `GET /dashboard` (HTML,
  not in the schema).
"""


def render(services: Sequence[Service] | None = None) -> str:
    """The whole reference page (Markdown, ending in one newline)."""
    services = build_services() if services is None else services
    by_slug = {service.slug: service for service in services}
    lines = [_PREAMBLE]
    for slug in ("worker", "router"):
        lines += _service_section(by_slug[slug])
    dashboard = by_slug.get("dashboard")
    if dashboard is not None:
        lines += [
            "## `kvmesh dashboard`",
            "",
            "The router's read-only routes, without routing (described above, under "
            "`kvmesh router`); it follows the cluster the same way.",
            "",
            *_overview(dashboard, link=False),
            "",
        ]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/apidoc.py",
        description="Print the HTTP API reference (docs/api.md) built from the OpenAPI schemas.",
    )
    parser.add_argument(
        "--check",
        metavar="FILE",
        type=Path,
        help="exit 1 if FILE differs from what would be printed",
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check is None:
        sys.stdout.write(text)
        return 0
    try:
        current = args.check.read_text(encoding="utf-8")
    except FileNotFoundError:
        current = ""
    if current == text:
        return 0
    diff = list(
        difflib.unified_diff(
            current.splitlines(),
            text.splitlines(),
            f"{args.check} (on disk)",
            f"{args.check} (from the schemas)",
            lineterm="",
        )
    )
    shown = "\n".join(diff[:60]) + ("\n..." if len(diff) > 60 else "")
    print(
        f"{args.check} is out of date with the OpenAPI schemas; regenerate it with "
        f"`{REGENERATE}`\n{shown}",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
