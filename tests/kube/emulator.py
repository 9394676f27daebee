"""``KubeEmulator``: a stateful Kubernetes API for kubectl and kopf, built on kmock's ``KubernetesScaffold``.

From kmock it takes the request record (``kmock.Request``s: iterate the emulator), the object store
(``kmock.ObjectsArray``: every version of every object, exposed as ``.objects``), the discovery record
(``kmock.ResourcesArray``) and the DSL for anything that is not an object path (``/version``, ``/``,
and user reactions such as ``emulator['/healthz'] << b'ok'``). Object paths (``/api/v1/...``,
``/apis/<group>/<version>/...``) are served here, synchronously, so each write and its watch event are
atomic; see ``objects.py`` for how a write becomes the next version.
"""

from __future__ import annotations

import datetime
import json
import logging
import random
import uuid
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml

from tests.kube import field_ownership, objects, printing
from tests.kube.paths import parse_api_path
from tests.kube.resources import (
    BUILTIN_TYPES,
    CRD_KEY,
    ResourceType,
    api_group,
    api_group_list,
    api_resource_list,
    crd_status,
    types_from_crd,
)
from tests.kube.selectors import Selector, SelectorError
from tests.kube.watching import WatchEvent, WatchHub, WatchScope, pump

log = logging.getLogger(__name__)
MAX_WATCH_SECONDS = 1800.0
_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"


def api_error(code: int, reason: str, message: str, rtype: ResourceType | None = None,
              name: str | None = None) -> kmock.KubernetesError:
    details: dict[str, Any] = {}
    if rtype is not None:
        details = {"group": rtype.group, "kind": rtype.plural} | ({"name": name} if name else {})
    return kmock.KubernetesError(status=code, reason=reason, message=message, details=details)


def status_body(code: int, reason: str, message: str, details: Any = None) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "details": details or {}, "code": code}


def _is_apply(request: kmock.Request) -> bool:
    return request.method == "PATCH" and request.headers.get("Content-Type", "").startswith(objects.APPLY_PATCH)


def _manager(request: kmock.Request) -> str:
    return field_ownership.manager_of(request.params.get("fieldManager"), request.headers.get("User-Agent", ""))


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesScaffold):
    _types: dict[kmock.resource, ResourceType] = attrs.field(factory=dict, init=False)
    _objects: kmock.ObjectsArray = attrs.field(factory=kmock.ObjectsArray, init=False)
    _watches: WatchHub = attrs.field(factory=WatchHub, init=False)
    _resource_version: int = attrs.field(default=0, init=False)
    _closing: bool = attrs.field(default=False, init=False)
    internal_errors: list[BaseException] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()  # kmock's discovery fallbacks; the _serve_* below override them
        for rtype in BUILTIN_TYPES:
            self.register(rtype)
        ns = next(t for t in BUILTIN_TYPES if t.plural == "namespaces")
        self._create(ns, None, {"metadata": {"name": "default"}})

    # --- public: types, objects, events --------------------------------------------------------
    def register(self, rtype: ResourceType) -> None:
        self._types[rtype.key] = rtype
        self._resources[rtype.key] = rtype.resource_info()

    def unregister(self, rtype: ResourceType) -> None:
        self._types.pop(rtype.key, None)
        self._resources.pop(rtype.key, None)

    @property
    def types(self) -> list[ResourceType]:
        return list(self._types.values())

    @property
    def objects(self) -> kmock.ObjectsArray:
        return self._objects

    def watch_history(self, rtype: ResourceType) -> list[WatchEvent]:
        return self._watches.history(rtype.key)

    def watch_streams(self, plural: str) -> int:
        """Watch streams open on resources of ``plural`` (subscribed: no later write is missed)."""
        return self._watches.streams(plural)

    def close(self) -> None:
        """End all watch streams (call on the server's loop before shutting the server down)."""
        self._closing = True
        self._watches.end_streams()

    # --- HTTP entry ------------------------------------------------------------------------------
    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        try:
            request = await self._parse(raw_request)
            self._requests.append(request)
            return await self._handle(request)
        except Exception as exc:
            if not isinstance(exc, kmock.KubernetesError):
                log.exception("emulated API server failed on %s %s", raw_request.method, raw_request.path_qs)
                self.internal_errors.append(exc)
            return await self._render_error(exc)

    async def _parse(self, raw: aiohttp.web.BaseRequest) -> kmock.Request:
        body = await raw.read()
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
            if raw.headers.get("Content-Type", "").startswith(objects.APPLY_PATCH):
                try:  # server-side apply takes YAML (JSON is YAML too)
                    data = yaml.safe_load(body)
                except yaml.YAMLError:
                    data = None
        parsed = parse_api_path(raw.path)
        group, version, namespace, plural, name, subresource = parsed or (None,) * 6
        action = {"GET": kmock.action.FETCH if name else kmock.action.LIST, "POST": kmock.action.CREATE,
                  "PUT": kmock.action.UPDATE, "PATCH": kmock.action.UPDATE,
                  "DELETE": kmock.action.DELETE}.get(raw.method) if parsed else None
        if parsed and raw.method == "GET" and raw.query.get("watch") in ("true", "1"):
            action = kmock.action.WATCH
        return kmock.Request(
            id=len(self._requests), raw_request=raw, url=raw.url, method=raw.method, params=dict(raw.query),
            headers=dict(raw.headers), cookies=dict(raw.cookies), body=body, text=body.decode(errors="replace"),
            data=data, action=action, namespace=namespace, name=name, subresource=subresource,
            resource=kmock.resource(group=group, version=version, plural=plural) if parsed else None)

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if isinstance(exc, kmock.KubernetesError):
            body = status_body(exc.status, exc.reason or "", exc.message or "", exc.details)
            return aiohttp.web.json_response(body, status=exc.status)
        return aiohttp.web.json_response(status_body(500, "InternalError", repr(exc)), status=500)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None or request.resource.plural is None:
            return await super()._handle(request)  # discovery & the kmock DSL
        rtype = self._types.get(request.resource)
        if rtype is None:
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        if request.action == kmock.action.WATCH:
            return await self._serve_watch(request, rtype)
        if request.params.get("dryRun"):
            raise api_error(400, "BadRequest", "dryRun is not emulated")
        content_type = request.headers.get("Content-Type", "")
        readable = "json" in content_type or content_type.startswith(objects.APPLY_PATCH)
        if request.method in ("POST", "PUT", "PATCH") and request.body and not readable:
            raise api_error(415, "UnsupportedMediaType", f"the emulated API server reads JSON bodies only, not "
                            f"{content_type!r} (kubectl: use `apply -f` rather than `create <kind>`)")
        status, body = self._serve(request, rtype)
        accept = request.headers.get("Accept", "")
        if request.method == "GET" and request.subresource is None and printing.wants_table(accept):
            items = body.get("items", [body])
            body = printing.table(rtype, items, resource_version=str(self._resource_version),
                                  include_object=request.params.get("includeObject", "Metadata"))
        return aiohttp.web.json_response(body, status=status)

    # --- discovery (overriding kmock's, which reports the core group as "/v1") -------------------
    async def _serve_api(self, request: kmock.Request) -> kmock.Payload:
        return {"kind": "APIVersions", "apiVersion": "v1", "versions": ["v1"]}

    async def _serve_apis(self, request: kmock.Request) -> kmock.Payload:
        return api_group_list(self._types.values())

    async def _serve_group(self, request: kmock.Request) -> kmock.Payload:
        group = request.url.path.strip("/").split("/")[1]
        versions = [t.version for t in self._types.values() if t.group == group]
        if not versions:
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        return api_group(group, versions)

    async def _serve_version(self, request: kmock.Request) -> kmock.Payload:
        parts = request.url.path.strip("/").split("/")
        group, version = ("", parts[1]) if parts[0] == "api" else (parts[1], parts[2])
        types = [t for t in self._types.values() if (t.group, t.version) == (group, version)]
        if not types:
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        return api_resource_list(group, version, types)

    # --- objects -----------------------------------------------------------------------------------
    def _serve(self, request: kmock.Request, rtype: ResourceType) -> tuple[int, dict[str, Any]]:
        namespace = request.namespace if rtype.namespaced else None
        name, sub, method = request.name, request.subresource, request.method
        if name is None:
            if method == "GET":
                return 200, self._list(rtype, namespace, self._selector(request))
            if method == "POST":
                return 201, self._create(rtype, namespace, request.data, _manager(request))
            if method == "DELETE":
                found = self._matching(rtype, namespace, None, self._selector(request))
                deleted = [self._delete(rtype, (rtype.key, namespace, o["metadata"]["name"]), None) for o in found]
                return 200, self._list_body(rtype, deleted)
            raise api_error(405, "MethodNotAllowed", f"{method} is not supported on a collection")
        if sub is not None and sub not in rtype.subresources():
            raise api_error(404, "NotFound", "the server could not find the requested resource", rtype, name)
        key = (rtype.key, namespace, name)
        if method == "PATCH" and sub is None and _is_apply(request) and (
                key not in self._objects or self._objects[key].deleted):
            return 201, self._apply_create(rtype, namespace, name, request)
        if method == "GET":
            current = self._current(rtype, key)
            return 200, objects.scale_of(current, rtype) if sub == "scale" else current
        if method in ("PUT", "PATCH"):
            written = self._update(rtype, key, request)
            return 200, objects.scale_of(written, rtype) if sub == "scale" else written
        if method == "DELETE" and sub is None:
            return 200, self._delete(rtype, key, request.data)
        raise api_error(405, "MethodNotAllowed", f"{method} is not supported here")

    def _selector(self, request: kmock.Request) -> Selector:
        try:
            return Selector.parse(request.params.get("labelSelector"), request.params.get("fieldSelector"))
        except SelectorError as exc:
            raise api_error(400, "BadRequest", str(exc)) from exc

    def _matching(self, rtype: ResourceType, namespace: str | None, name: str | None,
                  selector: Selector) -> list[dict[str, Any]]:
        scope = WatchScope(namespace, name, selector)
        found = [obj.raw for (res, _, _), obj in self._objects.items()
                 if res == rtype.key and not obj.deleted]
        found = [o for o in found if scope.covers(o)]
        return sorted(found, key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))

    def _list_body(self, rtype: ResourceType, items: list[dict[str, Any]]) -> dict[str, Any]:
        return {"kind": rtype.kind_of_list, "apiVersion": rtype.api_version,
                "metadata": {"resourceVersion": str(self._resource_version)}, "items": items}

    def _list(self, rtype: ResourceType, namespace: str | None, selector: Selector) -> dict[str, Any]:
        return self._list_body(rtype, self._matching(rtype, namespace, None, selector))

    def _current(self, rtype: ResourceType, key: tuple[kmock.resource, str | None, str]) -> dict[str, Any]:
        if key not in self._objects or self._objects[key].deleted:
            raise api_error(404, "NotFound", f'{rtype.group_resource} "{key[2]}" not found', rtype, key[2])
        return self._objects[key].raw

    def _create(self, rtype: ResourceType, namespace: str | None, body: Any,
                manager: str = "unknown") -> dict[str, Any]:
        if not isinstance(body, dict):
            raise api_error(400, "BadRequest", "the body of the request must be a JSON object")
        meta = body.get("metadata") or {}
        if rtype.namespaced:
            if namespace and meta.get("namespace") and meta["namespace"] != namespace:
                raise api_error(400, "BadRequest", "the namespace of the provided object does not match "
                                                   "the namespace sent on the request")
            namespace = namespace or meta.get("namespace") or "default"
        name = meta.get("name")
        if not name and meta.get("generateName"):
            name = meta["generateName"] + "".join(random.choices(_NAME_CHARS, k=5))
        if not name:
            raise api_error(422, "Invalid", f"{rtype.kind} is invalid: metadata.name: Required value: "
                                            "name or generateName is required", rtype)
        key = (rtype.key, namespace, name)
        if key in self._objects and not self._objects[key].deleted:
            raise api_error(409, "AlreadyExists", f'{rtype.group_resource} "{name}" already exists', rtype, name)
        obj = objects.new_object(body, rtype, name=name, namespace=namespace, uid=str(uuid.uuid4()),
                                 now=now_rfc3339())
        obj = field_ownership.record_update(None, obj, manager, tracks_status=not rtype.has_status,
                                            now=now_rfc3339())
        return self._commit(rtype, key, "ADDED", obj, None)

    def _apply_create(self, rtype: ResourceType, namespace: str | None, name: str,
                      request: kmock.Request) -> dict[str, Any]:
        """Server-side apply of an object that does not exist yet: created from the configuration."""
        config = self._apply_config(rtype, name, request)
        owned = field_ownership.apply(None, config, _manager(request), force=True,
                                      tracks_status=not rtype.has_status, now=now_rfc3339())
        obj = objects.new_object(owned, rtype, name=name, namespace=namespace, uid=str(uuid.uuid4()),
                                 now=now_rfc3339())
        obj["metadata"]["managedFields"] = owned["metadata"].get("managedFields", [])
        return self._commit(rtype, (rtype.key, namespace, name), "ADDED", obj, None)

    def _apply_config(self, rtype: ResourceType, name: str, request: kmock.Request) -> dict[str, Any]:
        if not request.params.get("fieldManager"):
            raise api_error(422, "Invalid", "PATCH: fieldManager is required for apply requests", rtype, name)
        try:
            return field_ownership.checked_config(request.data, rtype.api_version, rtype.kind, name)
        except ValueError as exc:
            raise api_error(400, "BadRequest", str(exc), rtype, name) from exc

    def _update(self, rtype: ResourceType, key: tuple[kmock.resource, str | None, str],
                request: kmock.Request) -> dict[str, Any]:
        old = self._current(rtype, key)
        sub = request.subresource
        if request.method == "PUT":
            desired = request.data
            if not isinstance(desired, dict):
                raise api_error(400, "BadRequest", "the body of the request must be a JSON object")
            body_name = (desired.get("metadata") or {}).get("name")
            if body_name and body_name != key[2]:
                raise api_error(400, "BadRequest", "the name of the object does not match the name on the URL")
        elif _is_apply(request):
            if sub is not None:
                raise api_error(415, "UnsupportedMediaType", "server-side apply of a subresource is not emulated")
            try:
                desired = field_ownership.apply(old, self._apply_config(rtype, key[2], request), _manager(request),
                                                force=request.params.get("force") in ("true", "1"),
                                                tracks_status=not rtype.has_status, now=now_rfc3339())
            except field_ownership.ApplyConflict as exc:
                raise api_error(409, "Conflict", str(exc), rtype, key[2]) from exc
        else:
            content_type = request.headers.get("Content-Type", "")
            try:
                base = objects.scale_of(old, rtype) if sub == "scale" else old
                desired = objects.apply_patch(base, request.data, content_type)
            except objects.PatchError as exc:
                raise api_error(422, "Invalid", str(exc), rtype, key[2]) from exc
        version = (desired.get("metadata") or {}).get("resourceVersion")
        if version and version != old["metadata"]["resourceVersion"]:
            raise api_error(409, "Conflict", f'Operation cannot be fulfilled on {rtype.group_resource} "{key[2]}": '
                            "the object has been modified; please apply your changes to the latest version "
                            "and try again", rtype, key[2])
        if sub == "scale":
            try:
                new = objects.next_version(old, objects.with_replicas(old, rtype, desired), rtype, None)
            except objects.PatchError as exc:
                raise api_error(422, "Invalid", str(exc), rtype, key[2]) from exc
        else:
            new = objects.next_version(old, desired, rtype, sub)
        if sub is None:
            if _is_apply(request):
                new["metadata"]["managedFields"] = desired["metadata"].get("managedFields", [])
            else:
                new["metadata"]["managedFields"] = old["metadata"].get("managedFields", [])
                new = field_ownership.record_update(old, new, _manager(request), tracks_status=not rtype.has_status,
                                                    now=now_rfc3339())
            if not new["metadata"]["managedFields"]:
                del new["metadata"]["managedFields"]
        if field_ownership.same_object(new, old):
            return old  # nothing changed: no new resourceVersion, no event
        meta = new["metadata"]
        deleting = bool(meta.get("deletionTimestamp")) and not meta.get("finalizers")
        return self._commit(rtype, key, "DELETED" if deleting else "MODIFIED", new, old)

    def _delete(self, rtype: ResourceType, key: tuple[kmock.resource, str | None, str],
                options: Any) -> dict[str, Any]:
        old = self._current(rtype, key)
        preconditions = (options.get("preconditions") if isinstance(options, dict) else None) or {}
        for field in ("uid", "resourceVersion"):
            if preconditions.get(field) and preconditions[field] != old["metadata"].get(field):
                raise api_error(409, "Conflict", f"Precondition failed: {field} in precondition: "
                                f"{preconditions[field]}, {field} in object meta: {old['metadata'].get(field)}",
                                rtype, key[2])
        if not old["metadata"].get("finalizers"):
            return self._commit(rtype, key, "DELETED", dict(old), old)
        if old["metadata"].get("deletionTimestamp"):
            return old
        generation = int(old["metadata"].get("generation", 0)) + 1  # as the API server does on marking
        new = dict(old, metadata=dict(old["metadata"], deletionTimestamp=now_rfc3339(),
                                      deletionGracePeriodSeconds=0, generation=generation))
        return self._commit(rtype, key, "MODIFIED", new, old)

    def _commit(self, rtype: ResourceType, key: tuple[kmock.resource, str | None, str], event_type: str,
                obj: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        """Store a new version (or the deletion), give it a resourceVersion, and publish its event."""
        if rtype.key == CRD_KEY and event_type != "DELETED":
            obj["status"] = crd_status(obj, now_rfc3339())
        self._resource_version += 1
        obj["metadata"] = dict(obj["metadata"], resourceVersion=str(self._resource_version))
        if key not in self._objects:
            self._objects[key] = obj
        elif event_type == "ADDED":
            self._objects[key].create(obj)
        else:
            self._objects[key].history.append(obj)
        if event_type == "DELETED":
            self._objects[key].delete()
        self._watches.publish(rtype.key, WatchEvent(self._resource_version, event_type, obj, old))
        if rtype.key == CRD_KEY:
            self._on_crd_written(event_type, obj, old)
        return obj

    def _on_crd_written(self, event_type: str, crd: dict[str, Any], old: dict[str, Any] | None) -> None:
        """The CRD controller's part: serve the CRD's types while it exists, drop their objects after."""
        builtin = {t.key for t in BUILTIN_TYPES}
        for rtype in types_from_crd(old) if old is not None else []:
            if rtype.key not in builtin:
                self.unregister(rtype)
        for rtype in types_from_crd(crd):
            if rtype.key in builtin:
                continue
            if event_type == "DELETED":
                for obj in self._matching(rtype, None, None, Selector()):
                    key = (rtype.key, obj["metadata"].get("namespace"), obj["metadata"]["name"])
                    self._commit(rtype, key, "DELETED", dict(obj), obj)
                self._watches.end_streams(rtype.key)
            else:
                self.register(rtype)

    # --- watch streams -------------------------------------------------------------------------------
    async def _serve_watch(self, request: kmock.Request, rtype: ResourceType) -> aiohttp.web.StreamResponse:
        params = request.params
        scope = WatchScope(request.namespace if rtype.namespaced else None, request.name, self._selector(request))
        table = printing.wants_table(request.headers.get("Accept", ""))
        include = params.get("includeObject", "Metadata")
        try:
            timeout = min(float(params.get("timeoutSeconds") or MAX_WATCH_SECONDS), MAX_WATCH_SECONDS)
        except ValueError as exc:
            raise api_error(400, "BadRequest", f"invalid timeoutSeconds {params['timeoutSeconds']!r}") from exc
        since = params.get("resourceVersion") or "0"
        initial_events = params.get("sendInitialEvents") == "true"

        def render(event_type: str, obj: dict[str, Any]) -> bytes:
            version = obj["metadata"].get("resourceVersion", "")
            shown = printing.table(rtype, [obj], resource_version=version, include_object=include) if table else obj
            return json.dumps({"type": event_type, "object": shown}).encode() + b"\n"

        queue = self._watches.subscribe(rtype.key)  # from here on, no write is missed
        try:
            initial: list[bytes] = []
            if since == "0" or initial_events:
                initial = [render("ADDED", o) for o in self._matching(rtype, scope.namespace, scope.name,
                                                                       scope.selector)]
                if initial_events:
                    mark = {"kind": rtype.kind, "apiVersion": rtype.api_version, "metadata": {
                        "resourceVersion": str(self._resource_version),
                        "annotations": {"k8s.io/initial-events-end": "true"}}}
                    initial.append(json.dumps({"type": "BOOKMARK", "object": mark}).encode() + b"\n")
            else:
                try:
                    events = self._watches.since(rtype.key, int(since))
                except ValueError as exc:
                    raise api_error(400, "BadRequest", f"invalid resourceVersion {since!r}") from exc
                if events is None:
                    gone = status_body(410, "Expired", f"too old resource version: {since}")
                    initial = [json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n"]
                else:
                    initial = [render(*seen) for seen in map(scope.view, events) if seen]
            raw = request._raw_request
            assert raw is not None  # always set for requests that came over HTTP
            response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(raw)
            await pump(response, initial, queue, scope, render, timeout, stop=lambda: self._closing,
                       client_gone=lambda: raw.transport is None or raw.transport.is_closing())
        finally:
            self._watches.unsubscribe(rtype.key, queue)
        return response
