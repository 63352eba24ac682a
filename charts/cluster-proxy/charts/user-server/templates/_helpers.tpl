{{/* The user-server's image: imageReference, or the image entry as every service's. Arguments:
the root context and the user-server's values (the subchart's .Values). */}}
{{- define "cluster-proxy.userServerImage" -}}
{{- $root := index . 0 -}}
{{- $values := index . 1 -}}
{{- $values.imageReference | default (include "cluster-proxy.image" (list $root $values.image)) -}}
{{- end }}
