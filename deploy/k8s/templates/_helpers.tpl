{{/*
Names, labels and the pieces every Tandem pod shares. Object names are "<fullname>-<component>".
*/}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Object name of a component: (dict "root" $ "component" "gateway") */}}
{{- define "tandem.componentName" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of a component: (dict "root" $ "component" "drafter" "pool" "ngram") */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- if .pool }}
tandem.io/drafter-pool: {{ .pool }}
{{- end }}
{{- end }}

{{/* All labels of a component's objects. */}}
{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" .root }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end }}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Stable gRPC address of verifier pod number .index (StatefulSet pod DNS via the headless Service). */}}
{{- define "tandem.verifierAddress" -}}
{{- $svc := include "tandem.componentName" (dict "root" .root "component" "verifier") -}}
{{- printf "%s-%d.%s.%s.svc.%s:%d" $svc (int .index) $svc .root.Release.Namespace .root.Values.clusterDomain (int .root.Values.verifier.port) }}
{{- end }}

{{/* The Redis URL for --redis-url, as an env entry (TANDEM_REDIS_URL is the CLI's envvar). */}}
{{- define "tandem.redisEnv" -}}
{{- $r := .Values.redis -}}
- name: TANDEM_REDIS_URL
{{- if $r.enabled }}
  value: {{ printf "redis://%s:%d/0" (include "tandem.componentName" (dict "root" . "component" "redis")) (int $r.port) | quote }}
{{- else if $r.external.existingSecret.name }}
  valueFrom:
    secretKeyRef:
      name: {{ $r.external.existingSecret.name }}
      key: {{ $r.external.existingSecret.key }}
{{- else if $r.external.url }}
  value: {{ $r.external.url | quote }}
{{- else }}
{{- fail "redis.enabled is false: set redis.external.url or redis.external.existingSecret.name" }}
{{- end }}
{{- end }}

{{/* The OTLP endpoint pods export to: tracing.otlpEndpoint, else the chart's Jaeger, else "". */}}
{{- define "tandem.otlpEndpoint" -}}
{{- if .Values.tracing.otlpEndpoint }}
{{- .Values.tracing.otlpEndpoint }}
{{- else if .Values.jaeger.enabled }}
{{- printf "http://%s:4317" (include "tandem.componentName" (dict "root" . "component" "jaeger")) }}
{{- end }}
{{- end }}

{{/*
Environment shared by every Tandem container: the standard OpenTelemetry SDK variables (tracing
is on when OTEL_EXPORTER_OTLP_ENDPOINT is set, see tandem/telemetry.py), the pod's name (verifier
ids and advertised addresses), the model cache and the offline switch.
(dict "root" $ "component" "gateway")
*/}}
{{- define "tandem.commonEnv" -}}
{{- $root := .root -}}
{{- $endpoint := include "tandem.otlpEndpoint" $root -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: TANDEM_CACHE
  value: /cache
- name: HF_HUB_OFFLINE
  value: "1"
- name: OTEL_SERVICE_NAME
  value: {{ printf "tandem-%s" .component | quote }}
{{- $attrs := list (printf "k8s.namespace.name=%s" $root.Release.Namespace) "k8s.pod.name=$(POD_NAME)" (printf "service.namespace=%s" (include "tandem.fullname" $root)) }}
{{- range $k, $v := $root.Values.tracing.resourceAttributes }}
{{- $attrs = append $attrs (printf "%s=%s" $k $v) }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attrs | quote }}
{{- if $endpoint }}
- name: OTEL_TRACES_EXPORTER
  value: otlp
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $endpoint | quote }}
{{- if hasPrefix "http://" $endpoint }}
- name: OTEL_EXPORTER_OTLP_INSECURE
  value: "true"
{{- end }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $root.Values.tracing.sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $root.Values.tracing.samplerArg | quote }}
{{- else }}
- name: OTEL_TRACES_EXPORTER
  value: none
{{- end }}
{{- end }}

{{/*
A model-weights volume source from a volume spec {type, claimName, hostPath}; empty for type none.
*/}}
{{- define "tandem.modelVolumeSource" -}}
{{- if eq .type "pvc" }}
persistentVolumeClaim:
  claimName: {{ required "a pvc model volume needs claimName" .claimName }}
  readOnly: true
{{- else if eq .type "hostPath" }}
hostPath:
  path: {{ required "a hostPath model volume needs hostPath" .hostPath }}
  type: Directory
{{- end }}
{{- end }}

{{/*
Resolve a model value against a volume spec: "default" and absolute paths stay as they are, a
relative path is joined to the volume's mountPath (and needs a volume). (dict "name" .. "volume" ..)
*/}}
{{- define "tandem.modelArg" -}}
{{- if or (eq .name "default") (hasPrefix "/" .name) }}
{{- .name }}
{{- else if eq .volume.type "none" }}
{{- fail (printf "model %q is a relative path but its volume type is none: set model.volume (or the pool's volume), use an absolute path, or \"default\"" .name) }}
{{- else }}
{{- printf "%s/%s" (trimSuffix "/" .volume.mountPath) .name }}
{{- end }}
{{- end }}

{{/* Whether a model value needs its volume mounted ("true" or ""). */}}
{{- define "tandem.needsVolume" -}}
{{- if and .name (ne .name "default") (not (hasPrefix "/" .name)) (ne .volume.type "none") }}true{{ end }}
{{- end }}

{{/* Volumes every Tandem pod has: /tmp and the model cache (both writable emptyDirs). */}}
{{- define "tandem.baseVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmp.sizeLimit }}
- name: cache
  emptyDir:
    {{- if .Values.cache.medium }}
    medium: {{ .Values.cache.medium }}
    {{- end }}
    sizeLimit: {{ .Values.cache.sizeLimit }}
{{- end }}

{{- define "tandem.baseVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /cache
{{- end }}

{{/* Prometheus scrape annotations for a pod serving metrics on port . (nothing when null). */}}
{{- define "tandem.scrapeAnnotations" -}}
{{- if and .root.Values.metrics.podAnnotations .port }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | int | quote }}
prometheus.io/path: {{ .root.Values.metrics.path | quote }}
{{- end }}
{{- end }}

{{/* --log-text / --log-json from logFormat. */}}
{{- define "tandem.logFormatFlag" -}}
{{- ternary "--log-json" "--log-text" (eq .Values.logFormat "json") }}
{{- end }}
