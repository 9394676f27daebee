{{/*
Names. Kubernetes names and label values are at most 63 characters: every name below is cut there
(a suffixed name cuts the prefix so that the suffix survives).
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "fusedserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-<chart>, or just the release name when it already contains the chart name, or fullnameOverride. */}}
{{- define "fusedserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The full name with a suffix, at most 63 characters: include "fusedserve.suffixed" (list . "metrics") */}}
{{- define "fusedserve.suffixed" -}}
{{- $root := index . 0 -}}
{{- $suffix := index . 1 -}}
{{- $prefix := include "fusedserve.fullname" $root | trunc (int (sub 62 (len $suffix))) | trimSuffix "-" -}}
{{- printf "%s-%s" $prefix $suffix -}}
{{- end -}}

{{/* chart-version, the helm.sh/chart label. */}}
{{- define "fusedserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "fusedserve.labels" -}}
helm.sh/chart: {{ include "fusedserve.chart" . }}
app.kubernetes.io/name: {{ include "fusedserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | trunc 63 | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: fusedserve
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The operator pod's selector (also the metrics Service's and ServiceMonitor's). */}}
{{- define "fusedserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fusedserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "fusedserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "fusedserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
An image reference from {registry, repository, tag, digest}: include "fusedserve.imageRef" (list . .Values.image)
global.imageRegistry replaces the registry; a digest replaces the tag; an empty tag is the appVersion.
*/}}
{{- define "fusedserve.imageRef" -}}
{{- $root := index . 0 -}}
{{- $image := index . 1 -}}
{{- $registry := default $image.registry ($root.Values.global).imageRegistry -}}
{{- $name := ternary (printf "%s/%s" $registry $image.repository) $image.repository (ne $registry "") -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $name $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $name (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "fusedserve.image" -}}
{{- include "fusedserve.imageRef" (list . .Values.image) -}}
{{- end -}}

{{/* The worker image InferenceDeployments run unless they set spec.image. */}}
{{- define "fusedserve.workerImage" -}}
{{- include "fusedserve.imageRef" (list . .Values.workerImage) -}}
{{- end -}}

{{/*
"true" when the Prometheus Operator objects (ServiceMonitor, PrometheusRule) render: monitoring.enabled is
true, or it is auto and the cluster serves monitoring.coreos.com/v1. Empty otherwise.
*/}}
{{- define "fusedserve.monitoring" -}}
{{- $mode := toString .Values.monitoring.enabled -}}
{{- if or (eq $mode "true") (and (eq $mode "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")) -}}
true
{{- end -}}
{{- end -}}

{{/*
The operator's permissions, exactly what it uses. Namespaced rules go into a Role per watched namespace (or the
ClusterRole when it watches all); cluster rules (CRDs, namespaces: cluster-scoped) always into the ClusterRole.
InferenceDeployments' scale subresource is not here: the operator never uses it (see the -edit role).
Secrets: it creates each deployment's Ray token, reads the API key a spec names, deletes them with it; pods:
it reads their init containers' status (failed model downloads); kopf.dev: the replicas' peering objects.
*/}}
{{- define "fusedserve.namespacedRules" -}}
- apiGroups: ["fusedserve.io"]
  resources: ["inferencedeployments"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["fusedserve.io"]
  resources: ["inferencedeployments/status"]
  verbs: ["get", "patch"]
- apiGroups: ["ray.io"]
  resources: ["rayclusters"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "list", "create", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "create", "patch"]
{{- end -}}

{{- define "fusedserve.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "create", "patch"]
{{- end -}}
