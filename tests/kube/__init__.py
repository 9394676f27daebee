"""An emulated Kubernetes API server for tests (kmock-based), good enough for kubectl and kopf.

- ``api_server``: ``KubeAPI`` runs the emulator on 127.0.0.1 in a background thread, writes a
  kubeconfig for it, and drives it with kubectl or plain HTTP.
- ``emulator``: ``KubeEmulator``, the kmock subclass that serves discovery, objects and watches.
- ``resources``: resource types (built-ins, CRD-defined) and the discovery documents.
- ``objects``: how an object's next version is made (patches, status/scale subresources, generation).
- ``field_ownership``: server-side apply and ``managedFields`` (who set which field; applied fields a manager
  drops are removed, other managers' fields kept, conflicts unless forced).
- ``watching``: watch events, their history and what one watch sees of them.
- ``printing``, ``jsonpath``, ``selectors``, ``paths``: server-side tables, JSONPath, selectors, API paths.
- ``fixtures``: the ``kube_api`` pytest fixture.
- ``cluster_player``: plays KubeRay, the heads' group controllers, kube-proxy and the kubelet for operator tests
  that run without Ray.
"""
