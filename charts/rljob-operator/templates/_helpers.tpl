{{/* Names and labels shared by every template. */}}

{{- define "rljob-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's full name: the release name, with the chart name appended unless it already holds it. */}}
{{- define "rljob-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rljob-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rljob-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rljob-operator.labels" -}}
{{ include "rljob-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "rljob-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rljob-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "rljob-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The Prometheus pods as one NetworkPolicy peer (the operator's policy and, through
--metrics-from, every RLJob's). */}}
{{- define "rljob-operator.prometheusPeer" -}}
{{- with .Values.networkPolicy.prometheus -}}
namespaceSelector:
  {{- toYaml (.namespaceSelector | default dict) | nindent 2 }}
podSelector:
  {{- toYaml (.podSelector | default dict) | nindent 2 }}
{{- end -}}
{{- end -}}
