{{/* Labels every object of this chart carries. */}}
{{- define "cluster-proxy.labels" -}}
app.kubernetes.io/name: cluster-proxy
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* An image reference: registry/name@digest, or registry/name:tag. Arguments: the root
context and the images.<key> entry. */}}
{{- define "cluster-proxy.image" -}}
{{- $root := index . 0 -}}
{{- $image := index . 1 -}}
{{- if $image.digest -}}
{{- printf "%s/%s@%s" $root.Values.registry $image.name $image.digest -}}
{{- else -}}
{{- printf "%s/%s:%s" $root.Values.registry $image.name ($root.Values.tag | default $root.Chart.AppVersion) -}}
{{- end -}}
{{- end }}

{{- define "cluster-proxy.proxyServerImage" -}}
{{- .Values.proxyServerImage | default (include "cluster-proxy.image" (list . .Values.images.proxyServer)) -}}
{{- end }}

{{- define "cluster-proxy.proxyAgentImage" -}}
{{- .Values.proxyAgentImage | default (include "cluster-proxy.image" (list . .Values.images.proxyAgent)) -}}
{{- end }}

{{- define "cluster-proxy.proxyServerNamespace" -}}
{{- .Values.proxyServer.namespace | default .Release.Namespace -}}
{{- end }}

{{- define "cluster-proxy.placementName" -}}
{{- .Values.installByPlacement.placementName | default "cluster-proxy-placement" -}}
{{- end }}

{{- define "cluster-proxy.placementNamespace" -}}
{{- .Values.installByPlacement.placementNamespace | default .Release.Namespace -}}
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
