"""kubeadm's and the kubelet's configuration files as typed models that refuse unknown fields.

kubeadm only warns about a field it does not know (a misspelt `cgroupDrivr` leaves the kubelet on its default
driver) and the kubelet ignores it, so ironserve validates every document before it renders one. The models
cover the fields ironserve renders and those a site may set; each alias is the upstream JSON name:
- kubeadm.k8s.io/v1beta4 (kubeadm 1.31): cmd/kubeadm/app/apis/kubeadm/v1beta4/types.go, as published in
  kubernetes/website content/en/docs/reference/config-api/kubeadm-config.v1beta4.md;
- kubelet.config.k8s.io/v1beta1: staging/src/k8s.io/kubelet/config/v1beta1/types.go.
tests/unit/samples/kubernetes-upstream-fields.yaml lists the upstream names per type with the revision it was
read at; a unit test checks every alias here against it.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

KUBEADM_API: Final = "kubeadm.k8s.io/v1beta4"
KUBELET_API: Final = "kubelet.config.k8s.io/v1beta1"
# A duration as Go's time.ParseDuration reads it in these files ("4m0s", "30s", "1h").
DURATION = r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"
QUANTITY = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|m|k|M|G|T)?$"


class KubeModel(BaseModel):
    """A part of a Kubernetes configuration document: upstream's JSON names, anything else refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def document(self) -> dict[str, Any]:
        """The JSON/YAML form: upstream names, unset fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class Arg(KubeModel):
    """v1beta4 extra arguments are a list of name/value pairs (duplicates allowed), not a map."""

    name: str = Field(min_length=1, pattern=r"^[a-z0-9][a-z0-9-]*$")
    value: str


class Taint(KubeModel):
    key: str = Field(min_length=1)
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]


class HostPathMount(KubeModel):
    name: str
    host_path: str = Field(alias="hostPath")
    mount_path: str = Field(alias="mountPath")
    read_only: StrictBool | None = Field(None, alias="readOnly")
    path_type: str | None = Field(None, alias="pathType")


class EnvVar(KubeModel):
    name: str
    value: str


class ControlPlaneComponent(KubeModel):
    extra_args: tuple[Arg, ...] | None = Field(None, alias="extraArgs")
    extra_volumes: tuple[HostPathMount, ...] | None = Field(None, alias="extraVolumes")
    extra_envs: tuple[EnvVar, ...] | None = Field(None, alias="extraEnvs")


class APIServer(ControlPlaneComponent):
    cert_sans: tuple[str, ...] | None = Field(None, alias="certSANs")


class APIEndpoint(KubeModel):
    advertise_address: str | None = Field(None, alias="advertiseAddress")
    bind_port: StrictInt | None = Field(None, alias="bindPort", ge=1, le=65535)


class NodeRegistrationOptions(KubeModel):
    name: str | None = None
    cri_socket: str | None = Field(None, alias="criSocket")
    taints: tuple[Taint, ...] | None = None
    kubelet_extra_args: tuple[Arg, ...] | None = Field(None, alias="kubeletExtraArgs")
    ignore_preflight_errors: tuple[str, ...] | None = Field(None, alias="ignorePreflightErrors")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(None, alias="imagePullPolicy")
    image_pull_serial: StrictBool | None = Field(None, alias="imagePullSerial")


class Networking(KubeModel):
    service_subnet: str | None = Field(None, alias="serviceSubnet")
    pod_subnet: str | None = Field(None, alias="podSubnet")
    dns_domain: str | None = Field(None, alias="dnsDomain")


class LocalEtcd(KubeModel):
    image_repository: str | None = Field(None, alias="imageRepository")
    image_tag: str | None = Field(None, alias="imageTag")
    data_dir: str | None = Field(None, alias="dataDir")
    extra_args: tuple[Arg, ...] | None = Field(None, alias="extraArgs")
    extra_envs: tuple[EnvVar, ...] | None = Field(None, alias="extraEnvs")
    server_cert_sans: tuple[str, ...] | None = Field(None, alias="serverCertSANs")
    peer_cert_sans: tuple[str, ...] | None = Field(None, alias="peerCertSANs")


class Etcd(KubeModel):
    local: LocalEtcd | None = None


class DNS(KubeModel):
    image_repository: str | None = Field(None, alias="imageRepository")
    image_tag: str | None = Field(None, alias="imageTag")
    disabled: StrictBool | None = None


class Proxy(KubeModel):
    disabled: StrictBool | None = None


class Timeouts(KubeModel):
    control_plane_component_health_check: str | None = Field(
        None, alias="controlPlaneComponentHealthCheck", pattern=DURATION
    )
    kubelet_health_check: str | None = Field(None, alias="kubeletHealthCheck", pattern=DURATION)
    kubernetes_api_call: str | None = Field(None, alias="kubernetesAPICall", pattern=DURATION)
    etcd_api_call: str | None = Field(None, alias="etcdAPICall", pattern=DURATION)
    tls_bootstrap: str | None = Field(None, alias="tlsBootstrap", pattern=DURATION)
    discovery: str | None = Field(None, pattern=DURATION)
    upgrade_manifests: str | None = Field(None, alias="upgradeManifests", pattern=DURATION)


class Patches(KubeModel):
    directory: str


class InitConfiguration(KubeModel):
    api_version: Literal["kubeadm.k8s.io/v1beta4"] = Field(KUBEADM_API, alias="apiVersion")
    kind: Literal["InitConfiguration"] = "InitConfiguration"
    node_registration: NodeRegistrationOptions | None = Field(None, alias="nodeRegistration")
    local_api_endpoint: APIEndpoint | None = Field(None, alias="localAPIEndpoint")
    skip_phases: tuple[str, ...] | None = Field(None, alias="skipPhases")
    patches: Patches | None = None
    timeouts: Timeouts | None = None


class ClusterConfiguration(KubeModel):
    api_version: Literal["kubeadm.k8s.io/v1beta4"] = Field(KUBEADM_API, alias="apiVersion")
    kind: Literal["ClusterConfiguration"] = "ClusterConfiguration"
    etcd: Etcd | None = None
    networking: Networking | None = None
    kubernetes_version: str | None = Field(None, alias="kubernetesVersion")
    control_plane_endpoint: str | None = Field(None, alias="controlPlaneEndpoint")
    api_server: APIServer | None = Field(None, alias="apiServer")
    controller_manager: ControlPlaneComponent | None = Field(None, alias="controllerManager")
    scheduler: ControlPlaneComponent | None = None
    dns: DNS | None = None
    proxy: Proxy | None = None
    certificates_dir: str | None = Field(None, alias="certificatesDir")
    image_repository: str | None = Field(None, alias="imageRepository")
    feature_gates: dict[str, StrictBool] | None = Field(None, alias="featureGates")
    cluster_name: str | None = Field(None, alias="clusterName")
    encryption_algorithm: Literal["RSA-2048", "RSA-3072", "RSA-4096", "ECDSA-P256"] | None = Field(
        None, alias="encryptionAlgorithm"
    )
    certificate_validity_period: str | None = Field(None, alias="certificateValidityPeriod", pattern=DURATION)
    ca_certificate_validity_period: str | None = Field(None, alias="caCertificateValidityPeriod", pattern=DURATION)


class BootstrapTokenDiscovery(KubeModel):
    token: str = Field(pattern=r"^[a-z0-9]{6}\.[a-z0-9]{16}$")
    api_server_endpoint: str = Field(alias="apiServerEndpoint")
    ca_cert_hashes: tuple[str, ...] = Field(alias="caCertHashes", min_length=1)


class Discovery(KubeModel):
    bootstrap_token: BootstrapTokenDiscovery = Field(alias="bootstrapToken")


class JoinControlPlane(KubeModel):
    local_api_endpoint: APIEndpoint | None = Field(None, alias="localAPIEndpoint")
    certificate_key: str = Field(alias="certificateKey", pattern=r"^[0-9a-f]{64}$")


class JoinConfiguration(KubeModel):
    api_version: Literal["kubeadm.k8s.io/v1beta4"] = Field(KUBEADM_API, alias="apiVersion")
    kind: Literal["JoinConfiguration"] = "JoinConfiguration"
    node_registration: NodeRegistrationOptions | None = Field(None, alias="nodeRegistration")
    discovery: Discovery
    control_plane: JoinControlPlane | None = Field(None, alias="controlPlane")
    skip_phases: tuple[str, ...] | None = Field(None, alias="skipPhases")
    timeouts: Timeouts | None = None


class KubeletX509(KubeModel):
    client_ca_file: str | None = Field(None, alias="clientCAFile")


class KubeletWebhookAuthn(KubeModel):
    enabled: StrictBool | None = None
    cache_ttl: str | None = Field(None, alias="cacheTTL", pattern=DURATION)


class KubeletAnonymousAuthn(KubeModel):
    enabled: StrictBool | None = None


class KubeletAuthentication(KubeModel):
    x509: KubeletX509 | None = None
    webhook: KubeletWebhookAuthn | None = None
    anonymous: KubeletAnonymousAuthn | None = None


class KubeletWebhookAuthz(KubeModel):
    cache_authorized_ttl: str | None = Field(None, alias="cacheAuthorizedTTL", pattern=DURATION)
    cache_unauthorized_ttl: str | None = Field(None, alias="cacheUnauthorizedTTL", pattern=DURATION)


class KubeletAuthorization(KubeModel):
    mode: Literal["AlwaysAllow", "Webhook"] | None = None
    webhook: KubeletWebhookAuthz | None = None


Resources = dict[Literal["cpu", "memory", "ephemeral-storage", "pid"], str]


class KubeletConfiguration(KubeModel):
    """The kubelet's config file; the fields a site may set besides those ironserve derives."""

    api_version: Literal["kubelet.config.k8s.io/v1beta1"] = Field(KUBELET_API, alias="apiVersion")
    kind: Literal["KubeletConfiguration"] = "KubeletConfiguration"
    cgroup_driver: Literal["systemd", "cgroupfs"] | None = Field(None, alias="cgroupDriver")
    container_runtime_endpoint: str | None = Field(None, alias="containerRuntimeEndpoint")
    authentication: KubeletAuthentication | None = None
    authorization: KubeletAuthorization | None = None
    cluster_dns: tuple[str, ...] | None = Field(None, alias="clusterDNS")
    cluster_domain: str | None = Field(None, alias="clusterDomain")
    static_pod_path: str | None = Field(None, alias="staticPodPath")
    healthz_bind_address: str | None = Field(None, alias="healthzBindAddress")
    healthz_port: StrictInt | None = Field(None, alias="healthzPort", ge=0, le=65535)
    resolv_conf: str | None = Field(None, alias="resolvConf")
    rotate_certificates: StrictBool | None = Field(None, alias="rotateCertificates")
    server_tls_bootstrap: StrictBool | None = Field(None, alias="serverTLSBootstrap")
    read_only_port: StrictInt | None = Field(None, alias="readOnlyPort", ge=0, le=65535)
    protect_kernel_defaults: StrictBool | None = Field(None, alias="protectKernelDefaults")
    seccomp_default: StrictBool | None = Field(None, alias="seccompDefault")
    fail_swap_on: StrictBool | None = Field(None, alias="failSwapOn")
    max_pods: StrictInt | None = Field(None, alias="maxPods", ge=1, le=2500)
    pod_pids_limit: StrictInt | None = Field(None, alias="podPidsLimit", ge=-1)
    system_reserved: Resources | None = Field(None, alias="systemReserved")
    kube_reserved: Resources | None = Field(None, alias="kubeReserved")
    eviction_hard: dict[str, str] | None = Field(None, alias="evictionHard")
    cpu_manager_policy: Literal["none", "static"] | None = Field(None, alias="cpuManagerPolicy")
    memory_manager_policy: Literal["None", "Static"] | None = Field(None, alias="memoryManagerPolicy")
    topology_manager_policy: Literal["none", "best-effort", "restricted", "single-numa-node"] | None = Field(
        None, alias="topologyManagerPolicy"
    )
    reserved_system_cpus: str | None = Field(None, alias="reservedSystemCPUs")
    image_gc_high_threshold_percent: StrictInt | None = Field(None, alias="imageGCHighThresholdPercent", ge=0, le=100)
    image_gc_low_threshold_percent: StrictInt | None = Field(None, alias="imageGCLowThresholdPercent", ge=0, le=100)
    serialize_image_pulls: StrictBool | None = Field(None, alias="serializeImagePulls")
    shutdown_grace_period: str | None = Field(None, alias="shutdownGracePeriod", pattern=DURATION)
    shutdown_grace_period_critical_pods: str | None = Field(
        None, alias="shutdownGracePeriodCriticalPods", pattern=DURATION
    )
    container_log_max_size: str | None = Field(None, alias="containerLogMaxSize", pattern=QUANTITY)
    container_log_max_files: StrictInt | None = Field(None, alias="containerLogMaxFiles", ge=2)
    feature_gates: dict[str, StrictBool] | None = Field(None, alias="featureGates")
    tls_min_version: str | None = Field(None, alias="tlsMinVersion")
    tls_cipher_suites: tuple[str, ...] | None = Field(None, alias="tlsCipherSuites")


def yaml_documents(*documents: KubeModel) -> str:
    """Documents as one multi-document YAML file, keys in the models' order."""
    return "---\n".join(yaml.safe_dump(d.document(), sort_keys=False) for d in documents)
