{{/* Labels every object of the umbrella and its subcharts carries, then global.commonLabels
(the schema keeps those off the chart's own label keys). `helm.sh/chart` names the
umbrella: the subcharts' versions are kept equal to it (charts/tests/check.py checks it), so the
label is the same whichever part renders the object. */}}
{{- define "cluster-proxy.labels" -}}
app.kubernetes.io/name: cluster-proxy
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "cluster-proxy-%s" .Chart.Version }}
{{- with .Values.global.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* An image reference: global.registry/name@digest, or global.registry/name:global.tag (the
chart's appVersion when the tag is empty). Arguments: the root context and an image entry
({name, digest}). */}}
{{- define "cluster-proxy.image" -}}
{{- $root := index . 0 -}}
{{- $image := index . 1 -}}
{{- if $image.digest -}}
{{- printf "%s/%s@%s" $root.Values.global.registry $image.name $image.digest -}}
{{- else -}}
{{- printf "%s/%s:%s" $root.Values.global.registry $image.name ($root.Values.global.tag | default $root.Chart.AppVersion) -}}
{{- end -}}
{{- end }}

{{- define "cluster-proxy.proxyServerNamespace" -}}
{{- .Values.global.proxyServerNamespace | default .Release.Namespace -}}
{{- end }}

{{- define "cluster-proxy.placementName" -}}
{{- .Values.global.installByPlacement.placementName | default "cluster-proxy-placement" -}}
{{- end }}

{{- define "cluster-proxy.placementNamespace" -}}
{{- .Values.global.installByPlacement.placementNamespace | default .Release.Namespace -}}
{{- end }}

{{/* The hardened container securityContext every container here runs with. */}}
{{- define "cluster-proxy.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "cluster-proxy.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Egress every hub pod needs: DNS and the kube-apiserver's ports (port-only peers, as
upstream); ingress to the health port only when a ServiceMonitor scrapes it. The kubelet's
probes are not subject to NetworkPolicy. */}}
{{- define "cluster-proxy.networkPolicyBaseRules" -}}
ingress:
  {{- if .Values.global.serviceMonitor.enabled }}
  - ports:
      - port: health
  {{- end }}
egress:
  - ports:
      - {port: 53, protocol: UDP}
      - {port: 53, protocol: TCP}
      - {port: 5353, protocol: UDP}
      - {port: 5353, protocol: TCP}
  - ports:
      {{- range .Values.global.networkPolicies.apiServerPorts }}
      - {port: {{ . }}, protocol: TCP}
      {{- end }}
  {{- with (.Values.global.otlp | default dict).endpoint }}
  {{- $url := urlParse . }}
  {{- $port := regexFind "[0-9]+$" $url.host | default (ternary "443" "80" (eq $url.scheme "https")) }}
  # The OTLP collector (global.otlp.endpoint).
  - ports:
      - {port: {{ $port }}, protocol: TCP}
  {{- end }}
{{- end }}

{{/* The metrics Service and ServiceMonitor of one hub service: /metrics is served on its
health port. Arguments: the root context, the object name prefix, the component label, the
namespace and the port. */}}
{{- define "cluster-proxy.serviceMonitor" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- $component := index . 2 -}}
{{- $namespace := index . 3 -}}
{{- $port := index . 4 -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}-metrics
  namespace: {{ $namespace }}
  labels:
    {{- include "cluster-proxy.labels" $root | nindent 4 }}
    component: {{ $component }}
spec:
  type: ClusterIP
  selector:
    open-cluster-management.io/addon: cluster-proxy
    component: {{ $component }}
  ports:
    - name: metrics
      port: {{ $port }}
      targetPort: health
---
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ $name }}
  namespace: {{ $namespace }}
  labels:
    {{- include "cluster-proxy.labels" $root | nindent 4 }}
    {{- with $root.Values.global.serviceMonitor.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      app.kubernetes.io/instance: {{ $root.Release.Name }}
      component: {{ $component }}
  endpoints:
    - port: metrics
      path: /metrics
      interval: {{ $root.Values.global.serviceMonitor.interval }}
{{- end }}

{{- /* The OpenTelemetry variables of a hub service's container (list <context> <service name>);
nothing when global.otlp.endpoint is empty. */}}
{{- define "cluster-proxy.otelEnv" -}}
{{- $ctx := index . 0 -}}
{{- $otlp := $ctx.Values.global.otlp | default dict -}}
{{- if $otlp.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $otlp.endpoint | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ index . 1 | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $otlp.sampler | default "parentbased_always_on" | quote }}
{{- with $otlp.samplerArg }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ . | quote }}
{{- end }}
{{- with $otlp.compression }}
- name: OTEL_EXPORTER_OTLP_COMPRESSION
  value: {{ . | quote }}
{{- end }}
{{- with $otlp.resourceAttributes }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ . | quote }}
{{- end }}
{{- with ($otlp.headersSecret | default dict) }}
{{- if .name }}
- name: OTEL_EXPORTER_OTLP_HEADERS
  valueFrom:
    secretKeyRef:
      name: {{ .name | quote }}
      key: {{ .key | default "headers" | quote }}
{{- end }}
{{- end }}
{{- if ($otlp.caConfigMap | default dict).name }}
- name: OTEL_EXPORTER_OTLP_CERTIFICATE
  value: /etc/otlp-ca/ca.crt
{{- end }}
{{- end }}
{{- end -}}

{{- /* The collector's CA bundle (global.otlp.caConfigMap) of a hub service: its volume mount
and its volume, each a YAML list item; nothing without an endpoint or a ConfigMap. The key
becomes ca.crt, so OTEL_EXPORTER_OTLP_CERTIFICATE above names one path whatever the key. */}}
{{- define "cluster-proxy.otelVolumeMounts" -}}
{{- $otlp := .Values.global.otlp | default dict -}}
{{- if and $otlp.endpoint ($otlp.caConfigMap | default dict).name }}
- name: otlp-ca
  mountPath: /etc/otlp-ca
  readOnly: true
{{- end }}
{{- end -}}

{{- define "cluster-proxy.otelVolumes" -}}
{{- $otlp := .Values.global.otlp | default dict -}}
{{- $ca := $otlp.caConfigMap | default dict -}}
{{- if and $otlp.endpoint $ca.name }}
- name: otlp-ca
  configMap:
    name: {{ $ca.name | quote }}
    items:
      - key: {{ $ca.key | default "ca.crt" | quote }}
        path: ca.crt
{{- end }}
{{- end -}}

{{- /* addon-manager's flags for the proxy-servers it runs: global.otlp, passed on (see
addon-manager's --proxy-server-otlp-*). Always the endpoint, so that an empty one means no
export, whatever addon-manager's own environment says. The Secret and the ConfigMap are
referenced by name in the proxy-server namespace, never copied. */}}
{{- define "cluster-proxy.proxyServerOtlpArgs" -}}
{{- $otlp := .Values.global.otlp | default dict }}
- --proxy-server-otlp-endpoint={{ $otlp.endpoint }}
{{- if $otlp.endpoint }}
- --proxy-server-otel-traces-sampler={{ $otlp.sampler | default "parentbased_always_on" }}
{{- with $otlp.samplerArg }}
- --proxy-server-otel-traces-sampler-arg={{ . }}
{{- end }}
{{- with $otlp.compression }}
- --proxy-server-otlp-compression={{ . }}
{{- end }}
{{- with $otlp.resourceAttributes }}
- --proxy-server-otel-resource-attributes={{ . }}
{{- end }}
{{- with ($otlp.headersSecret | default dict) }}
{{- if .name }}
- --proxy-server-otlp-headers-secret={{ .name }}
- --proxy-server-otlp-headers-secret-key={{ .key | default "headers" }}
{{- end }}
{{- end }}
{{- with ($otlp.caConfigMap | default dict) }}
{{- if .name }}
- --proxy-server-otlp-ca-configmap={{ .name }}
- --proxy-server-otlp-ca-configmap-key={{ .key | default "ca.crt" }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}
