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

{{/*
Every enabled drafter pool's Service address (FQDN:port), one a line. The gateway hands sessions to
these and each verifier is given the same list: a verifier refuses a drafter it was not given.
*/}}
{{- define "tandem.drafterAddresses" -}}
{{- range $poolName, $raw := .Values.drafters }}
{{- $pool := mergeOverwrite (deepCopy $.Values.drafterDefaults) (deepCopy (default dict $raw)) }}
{{- if $pool.enabled }}
{{ include "tandem.componentName" (dict "root" $ "component" (printf "drafter-%s" $poolName)) }}.{{ $.Release.Namespace }}.svc.{{ $.Values.clusterDomain }}:{{ $pool.port | int }}
{{- end }}
{{- end }}
{{- end }}

{{/* --drafter arguments for every enabled pool (the gateway's and the verifiers'). */}}
{{- define "tandem.drafterArgs" -}}
{{- range $address := include "tandem.drafterAddresses" . | splitList "\n" | compact }}
- --drafter={{ $address }}
{{- end }}
{{- end }}

{{/* -- Redis ------------------------------------------------------------------------------------ */}}

{{/* The Secret holding the chart's Redis password: redis.auth.existingSecret, or the generated one. */}}
{{- define "tandem.redisSecretName" -}}
{{- default (printf "%s-redis-auth" (include "tandem.fullname" .)) .Values.redis.auth.existingSecret.name }}
{{- end }}

{{/*
The Redis ACL users of the chart's own Redis, one per role that uses it (a drafter uses none): the
user name and the rules after its password. The commands are exactly those the role sends, on the
residency keys only; a gateway only reads. tandem/serving/residency.py (acl_rules) is the source,
tests/deploy checks these against it.
*/}}
{{- define "tandem.redisAclUser" -}}
{{- if eq . "gateway" -}}
tandem-gateway
{{- else -}}
tandem-verifier
{{- end -}}
{{- end }}
{{- define "tandem.redisAclRules" -}}
{{- $base := list "resetchannels" "resetkeys" "~tandem:v1:*" "-@all" "+ping" "+client|setinfo" "+hget" "+hmget" "+hgetall" "+zrange" "+smembers" -}}
{{- if eq . "verifier" -}}
{{- $base = concat $base (list "+hset" "+pexpire" "+zadd" "+zrem" "+zremrangebyscore" "+sadd" "+srem" "+del" "+scan") -}}
{{- end -}}
{{- toJson $base -}}
{{- end }}

{{/*
The Redis URL for --redis-url, as env entries (TANDEM_REDIS_URL is the CLI's envvar), for role
"gateway" or "verifier". The chart's own Redis: the URL names the role's ACL user and carries its
password as $(REDIS_PASSWORD), which Kubernetes expands from the entry defined just before it, so
the pod spec never shows the password itself.
*/}}
{{- define "tandem.redisEnv" -}}
{{- $r := .root.Values.redis -}}
{{- if $r.enabled -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "tandem.redisSecretName" .root }}
      key: {{ index $r.auth.existingSecret (printf "%sKey" .role) }}
- name: TANDEM_REDIS_URL
  value: {{ printf "redis://%s:$(REDIS_PASSWORD)@%s:%d/0" (include "tandem.redisAclUser" .role) (include "tandem.componentName" (dict "root" .root "component" "redis")) (int $r.port) | quote }}
{{- else if $r.external.existingSecret.name -}}
- name: TANDEM_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $r.external.existingSecret.name }}
      key: {{ $r.external.existingSecret.key }}
{{- else if $r.external.url -}}
- name: TANDEM_REDIS_URL
  value: {{ $r.external.url | quote }}
{{- else }}
{{- fail "redis.enabled is false: set redis.external.url or redis.external.existingSecret.name" }}
{{- end }}
{{- end }}

{{/* An external rediss:// server's CA (and client certificate): arguments, volume, mount. */}}
{{- define "tandem.redisTlsOn" -}}
{{- if .Values.redis.external.tls.existingSecret }}
{{- if .Values.redis.enabled }}
{{- fail "redis.external.tls is for an external Redis: set redis.enabled=false, or leave redis.external.tls.existingSecret empty" }}
{{- end }}true
{{- end }}
{{- end }}

{{- define "tandem.redisTlsArgs" -}}
{{- if include "tandem.redisTlsOn" . }}
- --redis-ca=/etc/tandem/redis-tls/ca.crt
{{- if .Values.redis.external.tls.clientCert }}
- --redis-cert=/etc/tandem/redis-tls/tls.crt
- --redis-key=/etc/tandem/redis-tls/tls.key
{{- end }}
{{- end }}
{{- end }}

{{- define "tandem.redisTlsVolume" -}}
{{- if include "tandem.redisTlsOn" . }}
- name: redis-tls
  secret:
    secretName: {{ .Values.redis.external.tls.existingSecret }}
    defaultMode: 288 # 0440: the pod's fsGroup reads it
    items:
      - key: ca.crt
        path: ca.crt
      {{- if .Values.redis.external.tls.clientCert }}
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      {{- end }}
{{- end }}
{{- end }}

{{- define "tandem.redisTlsVolumeMount" -}}
{{- if include "tandem.redisTlsOn" . }}
- name: redis-tls
  mountPath: /etc/tandem/redis-tls
  readOnly: true
{{- end }}
{{- end }}

{{/* -- Mutual TLS between the services ---------------------------------------------------------- */}}

{{/*
Where the services' certificates come from (tls.enabled): "certManager" (Certificates the chart
creates), "existing" (tls.existingSecrets, all three) or "generated" (a CA and certificates the
chart makes once, templates/secrets.yaml).
*/}}
{{- define "tandem.tlsSource" -}}
{{- $t := .Values.tls -}}
{{- $given := list -}}
{{- range $role := list "gateway" "verifier" "drafter" }}
{{- if index $t.existingSecrets $role }}
{{- $given = append $given $role }}
{{- end }}
{{- end }}
{{- if $t.certManager.enabled }}
{{- if $given }}
{{- fail "tls: use tls.certManager or tls.existingSecrets, not both" }}
{{- end }}
{{- "certManager" }}
{{- else if eq (len $given) 3 }}
{{- "existing" }}
{{- else if $given }}
{{- fail (printf "tls.existingSecrets: give all three of gateway, verifier and drafter (one CA signs them all), or none; given: %s" (join ", " $given)) }}
{{- else }}
{{- "generated" }}
{{- end }}
{{- end }}

{{/* The TLS Secret of a role: (dict "root" $ "role" "verifier") */}}
{{- define "tandem.tlsSecretName" -}}
{{- default (printf "%s-%s-tls" (include "tandem.fullname" .root) .role) (index .root.Values.tls.existingSecrets .role) }}
{{- end }}

{{/*
DNS names of a role's certificate, as a YAML list: tandem-<role> first (what callers check, by
ssl target name override, whatever address they dial), then the role's Service names, for tools
that dial by name. (dict "root" $ "role" "drafter")
*/}}
{{- define "tandem.tlsDnsNames" -}}
{{- $root := .root -}}
{{- $suffix := printf "%s.svc" $root.Release.Namespace -}}
{{- $services := list -}}
{{- if eq .role "drafter" }}
{{- range $address := include "tandem.drafterAddresses" $root | splitList "\n" | compact }}
{{- $services = append $services (regexReplaceAll "\\..*$" $address "") }}
{{- end }}
{{- else }}
{{- $services = list (include "tandem.componentName" (dict "root" $root "component" .role)) }}
{{- end }}
{{- $names := list (printf "tandem-%s" .role) }}
{{- range $svc := $services }}
{{- $names = append $names $svc }}
{{- $names = append $names (printf "%s.%s" $svc $suffix) }}
{{- $names = append $names (printf "%s.%s.%s" $svc $suffix $root.Values.clusterDomain) }}
{{- end }}
{{- if eq .role "verifier" }}
{{- $names = append $names (printf "*.%s.%s.%s" (index $services 0) $suffix $root.Values.clusterDomain) }}
{{- end }}
{{- toYaml (uniq $names) }}
{{- end }}

{{- define "tandem.tlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-cert=/etc/tandem/tls/tls.crt
- --tls-key=/etc/tandem/tls/tls.key
- --tls-ca=/etc/tandem/tls/ca.crt
{{- end }}
{{- end }}

{{/* The role's certificate, key and CA (cert-manager's Secret layout). (dict "root" $ "role" ..) */}}
{{- define "tandem.tlsVolume" -}}
{{- if .root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "tandem.tlsSecretName" . }}
    defaultMode: 288 # 0440: the pod's fsGroup reads it
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end }}

{{/* Mounted as a directory, not with subPath: Kubernetes then swaps renewed files in atomically
and the services pick them up for new connections without a restart. */}}
{{- define "tandem.tlsVolumeMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/tandem/tls
  readOnly: true
{{- end }}
{{- end }}

{{/* -- The gateway's callers ------------------------------------------------------------------- */}}

{{/* Whether the gateway checks API keys ("true" or ""): unless auth.allowUnauthenticated and no key
Secret is given. */}}
{{- define "tandem.apiKeysOn" -}}
{{- if or .Values.auth.apiKeys.existingSecret.name (not .Values.auth.allowUnauthenticated) }}true{{ end }}
{{- end }}

{{/* The Secret holding the API-key file: auth.apiKeys.existingSecret, or the generated one. */}}
{{- define "tandem.apiKeysSecretName" -}}
{{- default (printf "%s-api-keys" (include "tandem.fullname" .)) .Values.auth.apiKeys.existingSecret.name }}
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

{{/* Prometheus scrape annotations for a pod serving metrics on .port (nothing when null), over
.scheme when given (https: the gateway's public port with publicTls). */}}
{{- define "tandem.scrapeAnnotations" -}}
{{- if and .root.Values.metrics.podAnnotations .port }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | int | quote }}
prometheus.io/path: {{ .root.Values.metrics.path | quote }}
{{- with .scheme }}
prometheus.io/scheme: {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/* --log-text / --log-json from logFormat. */}}
{{- define "tandem.logFormatFlag" -}}
{{- ternary "--log-json" "--log-text" (eq .Values.logFormat "json") }}
{{- end }}

{{/* The service's drain grace at SIGTERM (--drain-grace-s), from its pod's budget: the kubelet
sends SIGTERM after the preStop sleep, and kills the container terminationGracePeriodSeconds after
the pod began terminating. The drain must end inside that: the grace, then up to 3 s for cut
streams to send their status, then the exit; 5 s are kept for those. Fails at install when the
budget leaves no grace at all. */}}
{{- define "tandem.drainGrace" -}}
{{- $grace := sub (sub (int .values.terminationGracePeriodSeconds) (int .values.preStopSleepSeconds)) 5 -}}
{{- if lt $grace 0 -}}
{{- fail (printf "%s: terminationGracePeriodSeconds (%d) must exceed preStopSleepSeconds (%d) by at least 5 s, the time a drain needs beyond its grace" .what (int .values.terminationGracePeriodSeconds) (int .values.preStopSleepSeconds)) -}}
{{- end -}}
{{- $grace -}}
{{- end }}
