/* nicoffload.p4: recognise nicoffload frames on the NIC and steer each one to where the plan
 * runs its stage (the DPU's Arm cores, the host, a GPU-bound queue); everything else goes to the
 * slow path. P4-16, v1model. See p4/README.md for how to compile it and what a DPL port changes.
 *
 * The nicoffload_t header must match nicoffload/transport/frame.py HEADER_FIELDS byte for byte
 * (names, widths, order): tests/unit/test_scapy_layer.py reads this file and checks it, and
 * tests/integration/test_p4_bmv2.py runs frames that frame.py encodes through it on BMv2.
 * Table, action and counter ids are pinned with @id so that p4/nicoffload.p4info.txtpb is the
 * P4Info p4c emits (tests/integration/test_p4_compile.py compiles this file and compares).
 */
#include <core.p4>
#include <v1model.p4>

const bit<16> ETHERTYPE_IPV4 = 0x0800;
const bit<8>  IPPROTO_UDP = 17;
const bit<16> NICOFFLOAD_UDP_PORT = 7700;
const bit<32> NICOFFLOAD_MAGIC = 0x4e49434f;  // "NICO"
const bit<8>  NICOFFLOAD_VERSION = 1;
const bit<9>  SLOW_PATH_PORT_UNSET = 0;       // the control plane writes the real default entry

// Why a packet went to the slow path: the index of slow_path_packets.
const bit<32> REASON_NOT_NICOFFLOAD = 0;      // not IPv4/UDP to NICOFFLOAD_UDP_PORT
const bit<32> REASON_BAD_HEADER = 1;          // the port matched but the header was cut short,
                                              // or its magic or version did not match
const bit<32> REASON_NO_ENTRY = 2;            // a nicoffload frame of no installed (pipeline, stage)

typedef bit<9> port_t;

header ethernet_t {
    bit<48> dst_addr;
    bit<48> src_addr;
    bit<16> ether_type;
}

header ipv4_t {
    bit<4>  version;
    bit<4>  ihl;
    bit<8>  diffserv;
    bit<16> total_len;
    bit<16> identification;
    bit<3>  flags;
    bit<13> frag_offset;
    bit<8>  ttl;
    bit<8>  protocol;
    bit<16> hdr_checksum;
    bit<32> src_addr;
    bit<32> dst_addr;
}

header udp_t {
    bit<16> src_port;
    bit<16> dst_port;
    bit<16> length;
    bit<16> checksum;
}

// The fixed 64-byte nicoffload frame header, network byte order.
header nicoffload_t {
    bit<32> magic;
    bit<8>  version;
    bit<8>  kind;
    bit<16> flags;
    bit<32> pipeline_id;
    bit<16> stage_id;
    bit<16> slot;
    bit<64> request_id;
    bit<32> batch_size;
    bit<32> meta_len;
    bit<64> payload_len;
    bit<8>  dtype;
    bit<8>  ndim;
    bit<16> reserved;
    bit<32> shape0;
    bit<32> shape1;
    bit<32> shape2;
    bit<32> shape3;
    bit<32> checksum;
}

struct headers_t {
    ethernet_t   ethernet;
    ipv4_t       ipv4;
    udp_t        udp;
    nicoffload_t nicoffload;
}

struct metadata_t {
    bit<32> pipeline_id;  // the steering key; 0/0 (never installed) for anything not nicoffload
    bit<16> stage_id;
    bit<16> queue;        // the receive queue chosen by forward(); see README (v1model has none)
    bit<32> reason;
}

parser NicoffloadParser(packet_in pkt, out headers_t hdr, inout metadata_t meta,
                        inout standard_metadata_t std_meta) {
    state start {
        pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }
    state parse_ipv4 {
        pkt.extract(hdr.ipv4);
        // Options or a non-first fragment: the UDP header is not where we look; slow path.
        transition select(hdr.ipv4.ihl, hdr.ipv4.frag_offset, hdr.ipv4.protocol) {
            (5, 0, IPPROTO_UDP): parse_udp;
            default: accept;
        }
    }
    state parse_udp {
        pkt.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            NICOFFLOAD_UDP_PORT: parse_nicoffload;
            default: accept;
        }
    }
    state parse_nicoffload {
        pkt.extract(hdr.nicoffload);
        transition accept;
    }
}

control NicoffloadVerifyChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply { }
}

control NicoffloadIngress(inout headers_t hdr, inout metadata_t meta,
                          inout standard_metadata_t std_meta) {
    @id(1) direct_counter(CounterType.packets_and_bytes) steer_hits;
    @id(1) counter(3, CounterType.packets_and_bytes) slow_path_packets;

    @id(1) action forward(port_t port, bit<16> queue) {
        std_meta.egress_spec = port;
        meta.queue = queue;
    }

    @id(2) action drop() {
        mark_to_drop(std_meta);
    }

    @id(3) action to_slow_path(port_t port) {
        std_meta.egress_spec = port;
        slow_path_packets.count(meta.reason);
    }

    // One entry per (pipeline, stage) of each installed plan; `nicoffload p4 entries` writes them.
    @id(1) table steer {
        key = {
            meta.pipeline_id: exact @name("pipeline_id");
            meta.stage_id: exact @name("stage_id");
        }
        actions = {
            @tableonly forward;
            @tableonly drop;
            @defaultonly to_slow_path;
        }
        default_action = to_slow_path(SLOW_PATH_PORT_UNSET);
        counters = steer_hits;
        size = 4096;
    }

    apply {
        meta.reason = REASON_NOT_NICOFFLOAD;
        if (hdr.nicoffload.isValid()) {
            if (hdr.nicoffload.magic == NICOFFLOAD_MAGIC
                    && hdr.nicoffload.version == NICOFFLOAD_VERSION) {
                meta.pipeline_id = hdr.nicoffload.pipeline_id;
                meta.stage_id = hdr.nicoffload.stage_id;
                meta.reason = REASON_NO_ENTRY;
            } else {
                meta.reason = REASON_BAD_HEADER;
            }
        } else if (hdr.udp.isValid() && hdr.udp.dst_port == NICOFFLOAD_UDP_PORT) {
            meta.reason = REASON_BAD_HEADER;  // the parser ran out of bytes inside the header
        }
        steer.apply();
    }
}

control NicoffloadEgress(inout headers_t hdr, inout metadata_t meta,
                         inout standard_metadata_t std_meta) {
    apply { }
}

control NicoffloadComputeChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply { }  // steering rewrites no header field
}

control NicoffloadDeparser(packet_out pkt, in headers_t hdr) {
    apply {
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.nicoffload);
    }
}

V1Switch(
    NicoffloadParser(),
    NicoffloadVerifyChecksum(),
    NicoffloadIngress(),
    NicoffloadEgress(),
    NicoffloadComputeChecksum(),
    NicoffloadDeparser()
) main;
