{{/* Names and labels. */}}

{{- define "magus.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The release's base name: <release>-magus, or the release name when it already contains the chart
name. At most 40 characters, so that "<fullname>-worker-pipeline" and the like stay DNS labels.
*/}}
{{- define "magus.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "magus.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object. */}}
{{- define "magus.labels" -}}
helm.sh/chart: {{ include "magus.chart" . }}
app.kubernetes.io/name: {{ include "magus.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: magus
{{- end -}}

{{/* Selector labels of one component: (dict "ctx" $ "component" "gateway" ["queue" "control"]). */}}
{{- define "magus.selectorLabels" -}}
app.kubernetes.io/name: {{ include "magus.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- with .queue }}
magus.dev/task-queue: {{ . }}
{{- end }}
{{- end -}}

{{/* Labels of one component's objects: (dict "ctx" $ "component" "gateway" ["queue" "control"]). */}}
{{- define "magus.componentLabels" -}}
{{ include "magus.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- with .queue }}
magus.dev/task-queue: {{ . }}
{{- end }}
{{- end -}}

{{/* The ServiceAccount of a component: (dict "ctx" $ "component" "runtime"): controller, runtime, pipeline, gateway. */}}
{{- define "magus.serviceAccountName" -}}
{{- printf "%s-%s" (include "magus.fullname" .ctx) .component -}}
{{- end -}}

{{- define "magus.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "magus.dllamaImage" -}}
{{- printf "%s:%s" .Values.dllamaImage.repository (default .Chart.AppVersion .Values.dllamaImage.tag) -}}
{{- end -}}

{{/*
The namespaces magus is confined to, as a JSON list: rbac.namespaces, or the deprecated
controller.watchNamespace as a list of one; [] = every namespace (cluster-wide). Both set fails.
*/}}
{{- define "magus.watchedNamespaces" -}}
{{- if and .Values.rbac.namespaces .Values.controller.watchNamespace -}}
{{- fail "set rbac.namespaces or the deprecated controller.watchNamespace, not both: move the namespace into rbac.namespaces" -}}
{{- end -}}
{{- if .Values.rbac.namespaces -}}
{{- toJson (uniq .Values.rbac.namespaces) -}}
{{- else if .Values.controller.watchNamespace -}}
{{- toJson (list .Values.controller.watchNamespace) -}}
{{- else -}}
{{- toJson (list) -}}
{{- end -}}
{{- end -}}

{{/* The namespaces of instance pods' NetworkPolicy: networkPolicy.instances.namespaces, else the watched ones, else the release namespace. */}}
{{- define "magus.instanceNamespaces" -}}
{{- $watched := include "magus.watchedNamespaces" . | fromJsonArray -}}
{{- if .Values.networkPolicy.instances.namespaces -}}
{{- toJson .Values.networkPolicy.instances.namespaces -}}
{{- else if $watched -}}
{{- toJson $watched -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}

{{/*
Environment of worker and controller: Temporal, NATS and the pod's namespace (MAGUS_NAMESPACE:
the controller's Lease, the default namespace of Secret references). HOME=/tmp: the root
filesystem is read-only.
*/}}
{{- define "magus.connectionEnv" -}}
- name: HOME
  value: /tmp
- name: MAGUS_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: MAGUS_TEMPORAL_ADDRESS
  value: {{ .Values.temporal.address | quote }}
- name: MAGUS_TEMPORAL_NAMESPACE
  value: {{ .Values.temporal.namespace | quote }}
- name: MAGUS_TASK_QUEUE
  value: {{ .Values.temporal.taskQueue | quote }}
- name: MAGUS_NATS_URL
  value: {{ .Values.nats.url | quote }}
{{- with .Values.nats.prefix }}
- name: MAGUS_NATS_PREFIX
  value: {{ . | quote }}
{{- end }}
{{- with .Values.nats.replicas }}
- name: MAGUS_NATS_REPLICAS
  value: {{ . | int64 | quote }}
{{- end }}
{{- with .Values.nats.responses.peakBytesPerSec }}
- name: MAGUS_RESPONSES_PEAK_BYTES_PER_SEC
  value: {{ . | int64 | quote }}
{{- end }}
{{- with .Values.nats.responses.retentionMs }}
- name: MAGUS_RESPONSES_RETENTION_MS
  value: {{ . | int64 | quote }}
{{- end }}
{{- end -}}

{{/* Pod-level scheduling fields of a component's values. */}}
{{- define "magus.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- end -}}

{{/* The /tmp emptyDir every magus container writes to (read-only root filesystem). */}}
{{- define "magus.tmpVolume" -}}
- name: tmp
  emptyDir:
    {{- with . }}
    sizeLimit: {{ . }}
    {{- else }}
    sizeLimit: 1Gi
    {{- end }}
{{- end -}}

{{/* A PodDisruptionBudget: (dict "ctx" $ "name" … "component" … "queue" … "pdb" …). */}}
{{- define "magus.pdb" -}}
{{- if .pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ .name }}
  namespace: {{ .ctx.Release.Namespace }}
  labels:
    {{- include "magus.componentLabels" . | nindent 4 }}
spec:
  {{- /* minAvailable, when set, wins over maxUnavailable (both are in the defaults). */}}
  {{- if not (kindIs "invalid" .pdb.minAvailable) }}
  minAvailable: {{ .pdb.minAvailable }}
  {{- else }}
  maxUnavailable: {{ .pdb.maxUnavailable | default 1 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "magus.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}

{{/*
A component's NATS user (nats.credentials.existingSecret: the files of magus nats-auth), for
(dict "ctx" $ "role" "gateway|worker|controller" ["signer" true: the worker that runs instances, which
signs each one's bridge user]): its env, mount and volume; nothing without one.
*/}}
{{- define "magus.natsCredentialsEnv" -}}
{{- if .ctx.Values.nats.credentials.existingSecret }}
- name: MAGUS_NATS_CREDENTIALS
  value: /etc/magus/nats/creds
{{- if .signer }}
# Each instance's bridge gets a NATS user of its own, signed with it, in a Secret of the instance.
- name: MAGUS_K8S_BRIDGE_NATS_SIGNER
  value: /etc/magus/nats/bridge-signer
{{- end }}
{{- end }}
{{- end -}}
{{- define "magus.natsCredentialsMount" -}}
{{- if .ctx.Values.nats.credentials.existingSecret }}
- name: nats-credentials
  mountPath: /etc/magus/nats
  readOnly: true
{{- end }}
{{- end -}}
{{- define "magus.natsCredentialsVolume" -}}
{{- with .ctx.Values.nats.credentials.existingSecret }}
- name: nats-credentials
  secret:
    secretName: {{ . }}
    defaultMode: 0400
    items:
      - {key: {{ printf "%s.creds" $.role }}, path: creds}
      {{- if $.signer }}
      - {key: bridge-signer.nk, path: bridge-signer}
      {{- end }}
{{- end }}
{{- end -}}
