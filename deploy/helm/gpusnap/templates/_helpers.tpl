{{- define "gpusnap.labels" -}}
app.kubernetes.io/name: gpusnap-agent
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: gpusnap
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end }}

{{- define "gpusnap.selector" -}}
app.kubernetes.io/name: gpusnap-agent
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}
