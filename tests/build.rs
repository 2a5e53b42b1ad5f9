//! Generates the tonic server and client of the gRPC tests' `payments.Payments` service, from a
//! description in Rust (tonic-build's `manual` builder): no `.proto` file and no `protoc`. The
//! messages are `prost` structs in `src/grpc.rs`.

fn main() {
    if std::env::var_os("CARGO_FEATURE_GRPC").is_none() {
        return;
    }
    let pay = tonic_build::manual::Method::builder()
        .name("pay")
        .route_name("Pay")
        .input_type("crate::grpc::PayRequest")
        .output_type("crate::grpc::Receipt")
        .codec_path("tonic_prost::ProstCodec")
        .build();
    let service = tonic_build::manual::Service::builder().name("Payments").package("payments").method(pay).build();
    tonic_build::manual::Builder::new().compile(&[service]);
}
