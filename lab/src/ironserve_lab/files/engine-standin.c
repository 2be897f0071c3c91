/* The lab's STAND-IN for the engine image's Python (the simulated edge of the lab Kubernetes node's blue/green
 * test, tests/lab/test_kubernetes_node_vm.py). The real image (vLLM and ironserve_service in a venv) cannot be
 * built or pulled here, so kubernetes_node.py builds an image holding this one static program at
 * the path the Deployment names as the interpreter (settings.engine.engine_python, /opt/ironserve/venv/bin/python
 * by default). It understands exactly the two command lines kube_objects.deployment gives that interpreter:
 *
 *   PYTHON -m ironserve_service launch --config FILE
 *       the launcher: writes readiness.loading_marker then readiness.ready_marker of FILE (/tmp/model_loading
 *       and /tmp/model_ready by default) holding its pid as the real launcher writes them ("<pid>\n", staged as
 *       .<name>.<pid>.tmp and renamed: launcher.write_marker), after checking that engine.model_dir can be read and
 *       listening on engine.host:engine.port (the colour's port, from FILE's `engine:` section). On SIGTERM or
 *       SIGINT: the ready marker goes first (the real launcher's drain order: leave the load balancer first), then
 *       the loading marker; the line "received signal N: draining; <ready marker> removed" goes to stderr and the
 *       termination message (/dev/termination-log), and it exits 0.
 *   PYTHON -m ironserve_service probe ready|live --config FILE
 *       the probes with health.probe_ready/probe_live's rules and messages: ready exits 0 only while the ready
 *       marker names a live pid (kill(pid, 0)); live exits 0 while the loading marker names a live pid, or while
 *       GET engine.base_url/health answers 200.
 *
 * What it does NOT do: no model is loaded (the directory is only opened), no GPU is touched, no vLLM runs, and
 * the HTTP listener answers GET /health with 200 and everything else with 404 (no /v1/models, no completions):
 * readiness here means "the launcher wrote its marker", not "the model answered", which the real launcher
 * checks before writing it. FILE is read line by line for `section:` / two-space `key: value` lines as
 * yaml.safe_dump writes the service's settings (kube_objects.config_map), not as YAML in general.
 *
 * Built with gcc -static (kubernetes_node.engine_standin_archive) so that the image needs nothing else; only
 * system calls ironserve's seccomp profile (files/security/ai-service.json) allows.
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#define TEXT 512

struct config {
  char loading_marker[TEXT], ready_marker[TEXT], model_dir[TEXT], host[TEXT];
  int port; /* 0: no `port:` under `engine:`, so no listener */
  double probe_timeout_s;
};

/* For the signal handler: only async-signal-safe calls there (unlink, open, write, _exit). */
static char drained_ready_marker[TEXT], drained_loading_marker[TEXT];
static char drained_line[2][TEXT * 2]; /* [0] SIGTERM, [1] SIGINT */

static void strip(char *text) {
  size_t length = strlen(text);
  while (length && (text[length - 1] == '\n' || text[length - 1] == '\r' || text[length - 1] == ' ')) {
    text[--length] = 0;
  }
  if (length >= 2 && (text[0] == '\'' || text[0] == '"') && text[length - 1] == text[0]) {
    memmove(text, text + 1, length - 2);
    text[length - 2] = 0;
  }
}

/* The value of `key` in the top-level `section` of FILE as yaml.safe_dump writes it; 1 when found. */
static int config_value(const char *file, const char *section, const char *key, char *out, size_t size) {
  char line[TEXT * 2], header[TEXT], prefix[TEXT];
  int inside = 0, found = 0;
  FILE *in = fopen(file, "r");
  if (!in) {
    return 0;
  }
  snprintf(header, sizeof header, "%s:", section);
  snprintf(prefix, sizeof prefix, "  %s: ", key);
  while (!found && fgets(line, sizeof line, in)) {
    if (line[0] != ' ' && line[0] != '\n') {
      strip(line);
      inside = strcmp(line, header) == 0;
    } else if (inside && strncmp(line, prefix, strlen(prefix)) == 0) {
      snprintf(out, size, "%s", line + strlen(prefix));
      strip(out);
      found = 1;
    }
  }
  fclose(in);
  return found;
}

static int read_config(const char *file, struct config *config) {
  char value[TEXT];
  if (access(file, R_OK) != 0) {
    fprintf(stderr, "config %s: %s\n", file, strerror(errno));
    return 0;
  }
  snprintf(config->loading_marker, TEXT, "/tmp/model_loading");
  snprintf(config->ready_marker, TEXT, "/tmp/model_ready");
  snprintf(config->host, TEXT, "127.0.0.1");
  config->model_dir[0] = 0;
  config->port = 0;
  config->probe_timeout_s = 2.0;
  config_value(file, "readiness", "loading_marker", config->loading_marker, TEXT);
  config_value(file, "readiness", "ready_marker", config->ready_marker, TEXT);
  config_value(file, "engine", "model_dir", config->model_dir, TEXT);
  config_value(file, "engine", "host", config->host, TEXT);
  if (config_value(file, "engine", "port", value, sizeof value)) {
    config->port = atoi(value);
  }
  if (config_value(file, "readiness", "probe_timeout_s", value, sizeof value) && atof(value) > 0) {
    config->probe_timeout_s = atof(value);
  }
  return 1;
}

/* launcher.write_marker: the staging file beside the marker, then an atomic rename. */
static int write_marker(const char *path, int pid) {
  char staging[TEXT * 2], content[32], directory[TEXT];
  const char *slash = strrchr(path, '/');
  size_t length = slash ? (size_t)(slash - path) : 0;
  snprintf(directory, sizeof directory, "%.*s", (int)length, path);
  snprintf(staging, sizeof staging, "%s/.%s.%d.tmp", length ? directory : ".", slash ? slash + 1 : path, pid);
  int size = snprintf(content, sizeof content, "%d\n", pid);
  int out = open(staging, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (out < 0 || write(out, content, (size_t)size) != size || close(out) != 0 || rename(staging, path) != 0) {
    fprintf(stderr, "marker %s: %s\n", path, strerror(errno));
    return 0;
  }
  return 1;
}

/* health.marker_pid: the first whitespace-separated word as an integer; -1 when absent or not a number. */
static long marker_pid(const char *path) {
  char text[64] = {0}, *end;
  int in = open(path, O_RDONLY);
  if (in < 0) {
    return -1;
  }
  ssize_t size = read(in, text, sizeof text - 1);
  close(in);
  if (size <= 0) {
    return -1;
  }
  char *word = text + strspn(text, " \t\n\r\f\v");
  long pid = strtol(word, &end, 10);
  if (end == word || (*end && !strchr(" \t\n\r\f\v", *end))) {
    return -1;
  }
  return pid;
}

/* health.pid_alive: kill(pid, 0); EPERM is a live process of another user. */
static int pid_alive(long pid) { return kill((pid_t)pid, 0) == 0 || errno == EPERM; }

static void drain(int signal_number) {
  const char *line = drained_line[signal_number == SIGINT];
  unlink(drained_ready_marker); /* first: the readiness probe fails from here on */
  unlink(drained_loading_marker);
  (void)!write(2, line, strlen(line));
  int log = open("/dev/termination-log", O_WRONLY | O_TRUNC);
  if (log >= 0) {
    (void)!write(log, line, strlen(line));
    close(log);
  }
  _exit(0);
}

static void answer(int client) {
  static const char health[] = "HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
  static const char body[] = "{\"error\": \"the lab's stand-in engine: no model, no completions\"}";
  char request[1024] = {0}, reply[512];
  struct timeval timeout = {.tv_sec = 2};
  setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  (void)!read(client, request, sizeof request - 1);
  if (strncmp(request, "GET /health ", 12) == 0) {
    (void)!write(client, health, sizeof health - 1);
  } else {
    int size = snprintf(reply, sizeof reply,
                        "HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
                        "Connection: close\r\n\r\n%s",
                        sizeof body - 1, body);
    (void)!write(client, reply, (size_t)size);
  }
  close(client);
}

static int launch(const struct config *config) {
  int pid = getpid(), one = 1, server = -1;
  snprintf(drained_ready_marker, TEXT, "%s", config->ready_marker);
  snprintf(drained_loading_marker, TEXT, "%s", config->loading_marker);
  for (int i = 0; i < 2; i++) {
    snprintf(drained_line[i], sizeof drained_line[i], "received signal %d: draining; %s removed\n",
             i ? SIGINT : SIGTERM, config->ready_marker);
  }
  /* As PID 1 of its container a signal without a handler is ignored: the kubelet would wait out the grace period
   * and SIGKILL it (exit 137), where the real launcher drains and exits 0. */
  signal(SIGTERM, drain);
  signal(SIGINT, drain);
  if (!write_marker(config->loading_marker, pid)) {
    return 1;
  }
  fprintf(stderr, "starting engine: the lab's stand-in (no model, no GPU); model_dir %s\n", config->model_dir);
  DIR *model = opendir(config->model_dir);
  if (!model) {
    fprintf(stderr, "engine exited with 1: model_dir %s: %s\n", config->model_dir, strerror(errno));
    unlink(config->loading_marker);
    return 1;
  }
  closedir(model);
  if (config->port > 0) {
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = htons((uint16_t)config->port)};
    server = socket(AF_INET, SOCK_STREAM, 0);
    setsockopt(server, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (server < 0 || inet_pton(AF_INET, config->host, &address.sin_addr) != 1 ||
        bind(server, (struct sockaddr *)&address, sizeof address) != 0 || listen(server, 16) != 0) {
      fprintf(stderr, "engine exited with 1: listen on %s:%d: %s\n", config->host, config->port, strerror(errno));
      unlink(config->loading_marker);
      return 1;
    }
    fprintf(stderr, "listening on %s:%d (GET /health only)\n", config->host, config->port);
  } else {
    fprintf(stderr, "no engine.port in the config: no listener\n");
  }
  if (!write_marker(config->ready_marker, pid)) {
    unlink(config->loading_marker);
    return 1;
  }
  unlink(config->loading_marker);
  fprintf(stderr, "engine ready: stand-in marker written (pid %d)\n", pid);
  for (;;) {
    if (server < 0) {
      pause();
      continue;
    }
    int client = accept(server, NULL, NULL);
    if (client >= 0) {
      answer(client);
    }
  }
}

/* GET base_url/health as health.http_json does: the HTTP status, or -1 with errno set. */
static int get_health(const struct config *config) {
  struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = htons((uint16_t)config->port)};
  struct timeval timeout = {.tv_sec = (long)config->probe_timeout_s,
                            .tv_usec = (long)((config->probe_timeout_s - (long)config->probe_timeout_s) * 1e6)};
  char request[TEXT * 2], reply[256] = {0};
  int status = -1, sock = socket(AF_INET, SOCK_STREAM, 0);
  if (sock < 0) {
    return -1;
  }
  if (inet_pton(AF_INET, config->host, &address.sin_addr) != 1) {
    close(sock);
    errno = EINVAL;
    return -1;
  }
  setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  int size = snprintf(request, sizeof request, "GET /health HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n",
                      config->host, config->port);
  if (connect(sock, (struct sockaddr *)&address, sizeof address) == 0 && write(sock, request, (size_t)size) == size) {
    errno = EPROTO; /* an answer that is not an HTTP status line */
    if (read(sock, reply, sizeof reply - 1) > 0 && sscanf(reply, "HTTP/%*s %d", &status) != 1) {
      status = -1;
    }
  }
  int saved = errno;
  close(sock);
  errno = saved;
  return status;
}

static int probe(const char *kind, const struct config *config) {
  long pid;
  if (strcmp(kind, "ready") == 0) {
    pid = marker_pid(config->ready_marker);
    if (pid < 0) {
      printf("%s absent: model not ready\n", config->ready_marker);
      return 1;
    }
    if (!pid_alive(pid)) {
      printf("%s is stale: launcher %ld is gone\n", config->ready_marker, pid);
      return 1;
    }
    printf("model ready (launcher %ld)\n", pid);
    return 0;
  }
  pid = marker_pid(config->loading_marker);
  if (pid >= 0 && pid_alive(pid)) {
    printf("model loading (launcher %ld)\n", pid);
    return 0;
  }
  int status = config->port > 0 ? get_health(config) : -1;
  if (status < 0) {
    int error = config->port > 0 ? errno : ECONNREFUSED;
    printf("engine unreachable and not loading: <urlopen error [Errno %d] %s>\n", error,
           config->port > 0 ? strerror(error) : "no engine.port in the config");
    return 1;
  }
  printf("/health answered %d\n", status);
  return status == 200 ? 0 : 1;
}

int main(int argc, char **argv) {
  struct config config;
  int launching = argc == 6 && strcmp(argv[3], "launch") == 0;
  int probing = argc == 7 && strcmp(argv[3], "probe") == 0 &&
                (strcmp(argv[4], "ready") == 0 || strcmp(argv[4], "live") == 0);
  const char *file = argv[argc - 1];
  if (argc < 6 || strcmp(argv[1], "-m") != 0 || strcmp(argv[2], "ironserve_service") != 0 ||
      strcmp(argv[argc - 2], "--config") != 0 || !(launching || probing)) {
    fprintf(stderr,
            "usage: %s -m ironserve_service launch --config FILE\n"
            "       %s -m ironserve_service probe ready|live --config FILE\n"
            "(the lab's stand-in for the engine image's Python: nothing else)\n",
            argv[0], argv[0]);
    return 2;
  }
  if (!read_config(file, &config)) {
    return 1;
  }
  setvbuf(stdout, NULL, _IONBF, 0);
  return launching ? launch(&config) : probe(argv[4], &config);
}
