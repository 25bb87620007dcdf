{{- define "multimax-serve.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "multimax-serve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "multimax-serve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "multimax-serve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "multimax-serve.labels" -}}
{{ include "multimax-serve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "multimax-serve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The Secret holding the API key file, or "" when there are no keys. */}}
{{- define "multimax-serve.apiKeysSecret" -}}
{{- if and .Values.apiKeys.create .Values.apiKeys.existingSecret -}}
{{- fail "apiKeys: set either existingSecret or create, not both" -}}
{{- else if .Values.apiKeys.existingSecret -}}
{{- .Values.apiKeys.existingSecret -}}
{{- else if .Values.apiKeys.create -}}
{{- if not .Values.apiKeys.keys -}}
{{- fail "apiKeys.create needs at least one key in apiKeys.keys" -}}
{{- end -}}
{{- printf "%s-api-keys" (include "multimax-serve.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Seconds the pod gets between the preStop hook and SIGKILL: the hook's sleep, the server's grace period,
     then time for the lifespan shutdown to drain the batchers and decode loops. */}}
{{- define "multimax-serve.terminationGrace" -}}
{{- $needed := add (int .Values.preStopSleepSeconds) (int (ceil .Values.server.gracefulTimeoutSeconds)) -}}
{{- if .Values.terminationGracePeriodSeconds -}}
{{- if le (int .Values.terminationGracePeriodSeconds) $needed -}}
{{- fail (printf "terminationGracePeriodSeconds (%v) must exceed preStopSleepSeconds + server.gracefulTimeoutSeconds (%v)" .Values.terminationGracePeriodSeconds $needed) -}}
{{- end -}}
{{- .Values.terminationGracePeriodSeconds -}}
{{- else -}}
{{- add $needed 15 -}}
{{- end -}}
{{- end -}}

{{/* Arguments of `python -m service` shared by the Deployment and the KServe runtime. */}}
{{- define "multimax-serve.commonArgs" -}}
- --host=0.0.0.0
- --graceful-timeout-s={{ .Values.server.gracefulTimeoutSeconds }}
- --log-format={{ .Values.server.logFormat }}
- --log-level={{ .Values.server.logLevel }}
- --warmup-calls={{ .Values.server.warmupCalls }}
{{- range .Values.server.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}
