// The ironserve lab's stand-in of NVIDIA's device plugin: the lab VM's kubelet learns of the hardware profile's GPUs
// through the real device-plugin API (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1, the kubelet's own package,
// built from the same Kubernetes 1.20.2 source tree), as it would from NVIDIA's plugin on an R740.
//
// Lab edge only: there are no GPUs behind the IDs. What is real is everything the kubelet and the scheduler do with
// them: registration, the node's capacity and allocatable `nvidia.com/gpu`, exclusive allocation to containers, and
// the container's NVIDIA_VISIBLE_DEVICES, which is what NVIDIA's plugin returns with its default envvar strategy
// (the container runtime's nvidia hook reads it). Devices are the GPU UUIDs given on the command line (the lab
// reads them from the hardware profile, like its stand-in nvidia-smi); each is healthy.
//
// Like NVIDIA's plugin, it registers again when the kubelet's socket is created anew (a kubelet restart removes
// every plugin's registration), and it exits on SIGTERM.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

const visibleDevices = "NVIDIA_VISIBLE_DEVICES"

type plugin struct {
	devices []*pluginapi.Device
	known   map[string]bool
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{GetPreferredAllocationAvailable: true}, nil
}

// ListAndWatch sends the devices once; they never change health, so the stream then waits for the kubelet to end it.
func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream pluginapi.DevicePlugin_ListAndWatchServer) error {
	if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	<-stream.Context().Done()
	return nil
}

// GetPreferredAllocation prefers the lowest-numbered GPUs, as the profile's serving GPUs are the lowest slots.
func (p *plugin) GetPreferredAllocation(
	_ context.Context, request *pluginapi.PreferredAllocationRequest,
) (*pluginapi.PreferredAllocationResponse, error) {
	response := &pluginapi.PreferredAllocationResponse{}
	for _, container := range request.ContainerRequests {
		chosen := append([]string{}, container.MustIncludeDeviceIDs...)
		for _, device := range p.devices {
			if len(chosen) >= int(container.AllocationSize) {
				break
			}
			if contains(container.AvailableDeviceIDs, device.ID) && !contains(chosen, device.ID) {
				chosen = append(chosen, device.ID)
			}
		}
		response.ContainerResponses = append(
			response.ContainerResponses, &pluginapi.ContainerPreferredAllocationResponse{DeviceIDs: chosen},
		)
	}
	return response, nil
}

func (p *plugin) Allocate(_ context.Context, request *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	response := &pluginapi.AllocateResponse{}
	for _, container := range request.ContainerRequests {
		for _, id := range container.DevicesIDs {
			if !p.known[id] {
				return nil, fmt.Errorf("unknown device %q", id)
			}
		}
		envs := map[string]string{visibleDevices: strings.Join(container.DevicesIDs, ",")}
		response.ContainerResponses = append(response.ContainerResponses, &pluginapi.ContainerAllocateResponse{Envs: envs})
	}
	return response, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func contains(items []string, wanted string) bool {
	for _, item := range items {
		if item == wanted {
			return true
		}
	}
	return false
}

// serve listens on the plugin's socket and registers it with the kubelet; the server is stopped by the caller.
func serve(p *plugin, socket, resource string) (*grpc.Server, error) {
	if err := os.Remove(socket); err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	listener, err := net.Listen("unix", socket)
	if err != nil {
		return nil, err
	}
	server := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(server, p)
	go func() {
		if err := server.Serve(listener); err != nil {
			log.Printf("serving %s: %v", socket, err)
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dialer := func(ctx context.Context, address string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", address)
	}
	connection, err := grpc.DialContext(ctx, pluginapi.KubeletSocket, grpc.WithInsecure(), grpc.WithBlock(), grpc.WithContextDialer(dialer))
	if err != nil {
		server.Stop()
		return nil, fmt.Errorf("reaching the kubelet at %s: %v", pluginapi.KubeletSocket, err)
	}
	defer connection.Close()
	request := &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     filepath.Base(socket),
		ResourceName: resource,
		Options:      &pluginapi.DevicePluginOptions{GetPreferredAllocationAvailable: true},
	}
	if _, err := pluginapi.NewRegistrationClient(connection).Register(ctx, request); err != nil {
		server.Stop()
		return nil, fmt.Errorf("registering %s: %v", resource, err)
	}
	log.Printf("registered %s with %d devices at %s", resource, len(p.devices), socket)
	return server, nil
}

func inode(path string) uint64 {
	info, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return info.Sys().(*syscall.Stat_t).Ino
}

func main() {
	resource := flag.String("resource", "nvidia.com/gpu", "the extended resource the devices are offered as")
	ids := flag.String("devices", "", "the GPUs' UUIDs, comma-separated")
	flag.Parse()
	p := &plugin{known: map[string]bool{}}
	for _, id := range strings.Split(*ids, ",") {
		if id = strings.TrimSpace(id); id != "" {
			p.devices = append(p.devices, &pluginapi.Device{ID: id, Health: pluginapi.Healthy})
			p.known[id] = true
		}
	}
	if len(p.devices) == 0 {
		log.Fatal("no devices: pass --devices UUID[,UUID...]")
	}
	socket := filepath.Join(pluginapi.DevicePluginPath, "ironserve-lab-gpu.sock")
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	var server *grpc.Server
	registeredWith := uint64(0)
	ticker := time.NewTicker(time.Second)
	defer ticker.Stop()
	for {
		if current := inode(pluginapi.KubeletSocket); current != 0 && current != registeredWith {
			if server != nil {
				server.Stop()
			}
			var err error
			if server, err = serve(p, socket, *resource); err != nil {
				log.Printf("%v; trying again", err)
			} else {
				registeredWith = current
			}
		}
		select {
		case <-stop:
			if server != nil {
				server.Stop()
			}
			os.Remove(socket)
			return
		case <-ticker.C:
		}
	}
}
