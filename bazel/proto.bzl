"""wtx_c_proto: protobuf-c messages plus wtx C gRPC stubs for .proto files.

Runs Debian's protoc with protobuf-c's plugin (messages, X.pb-c.{c,h}) and,
unless grpc = False, our own //codegen:protoc-gen-wtxc (stubs, tables and
embedded descriptors, X.grpc-c.{c,h}), then compiles both into one cc_library.
Generated headers are included by import path: "wtx/v1/types.pb-c.h".
"""

_PROTOC = "@system//:protoc"
_PROTOC_GEN_C = "@system//:protoc_gen_c"
_PROTOC_GEN_WTXC = "//codegen:protoc-gen-wtxc"

def wtx_c_proto(
        name,
        srcs,
        proto_root,
        protos,
        grpc = True,
        deps = [],
        extra_proto_roots = [],
        extra_proto_srcs = [],
        testonly = False,
        visibility = None):
    """Generates and compiles C code for protos.

    Args:
      name: the cc_library's name.
      srcs: labels of the .proto files to generate.
      proto_root: execroot-relative directory their import paths start from
        ("proto" for //proto, "external/system/include" for @system).
      protos: the import paths of srcs, in the same order.
      grpc: also run protoc-gen-wtxc.
      deps: cc deps (the libraries generated for imported protos).
      extra_proto_roots: more -I directories for imports outside proto_root.
      extra_proto_srcs: labels of the imported .proto files (action inputs).
      testonly: for test-only protos.
      visibility: visibility of the library.
    """
    outs = []
    for p in protos:
        if not p.endswith(".proto"):
            fail("%s: not a .proto import path" % p)
        base = p[:-len(".proto")]
        outs += [base + ".pb-c.c", base + ".pb-c.h"]
        if grpc:
            outs += [base + ".grpc-c.c", base + ".grpc-c.h"]
    tools = [_PROTOC, _PROTOC_GEN_C]
    cmd = ("$(location %s) --plugin=protoc-gen-c=$(location %s) " % (_PROTOC, _PROTOC_GEN_C) +
           "--c_out=$(RULEDIR) ")
    if grpc:
        tools.append(_PROTOC_GEN_WTXC)
        cmd += ("--plugin=protoc-gen-wtxc=$(location %s) --wtxc_out=$(RULEDIR) " %
                _PROTOC_GEN_WTXC)
    cmd += "-I%s " % proto_root
    for r in extra_proto_roots:
        cmd += "-I%s " % r
    cmd += " ".join(["%s/%s" % (proto_root, p) for p in protos])
    native.genrule(
        name = name + "_gen",
        srcs = srcs + extra_proto_srcs,
        outs = outs,
        tools = tools,
        cmd = cmd,
        testonly = testonly,
        # The generated sources, for targets built outside Bazel's C
        # toolchain (the clang fuzz targets of //fuzz).
        visibility = visibility,
    )
    runtime = ["//rpc"] if grpc else []
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".c")],
        hdrs = [o for o in outs if o.endswith(".h")],
        includes = ["."],
        # protobuf-c's generated initializers leave fields implicit.
        copts = ["-Wno-missing-field-initializers"],
        deps = deps + runtime + ["@system//:protobuf_c"],
        testonly = testonly,
        visibility = visibility,
    )
