{{/* The umbrella's own helpers; the shared ones are in the library chart charts/common. */}}
{{- define "cluster-proxy.proxyServerImage" -}}
{{- .Values.proxyServerImage | default (include "cluster-proxy.image" (list . .Values.images.proxyServer)) -}}
{{- end }}

{{- define "cluster-proxy.proxyAgentImage" -}}
{{- .Values.proxyAgentImage | default (include "cluster-proxy.image" (list . .Values.images.proxyAgent)) -}}
{{- end }}
