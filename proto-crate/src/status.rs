//! gRPC status codes as grpc-go names them. Upstream's metrics label stream
//! errors with `codes.Code.String()`, and dashboards match those strings.

/// The code as Go's `codes.Code.String()` spells it (tonic's Debug says
/// `Cancelled`; Go says `Canceled`).
pub fn go_code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "Canceled",
        Code::Unknown => "Unknown",
        Code::InvalidArgument => "InvalidArgument",
        Code::DeadlineExceeded => "DeadlineExceeded",
        Code::NotFound => "NotFound",
        Code::AlreadyExists => "AlreadyExists",
        Code::PermissionDenied => "PermissionDenied",
        Code::ResourceExhausted => "ResourceExhausted",
        Code::FailedPrecondition => "FailedPrecondition",
        Code::Aborted => "Aborted",
        Code::OutOfRange => "OutOfRange",
        Code::Unimplemented => "Unimplemented",
        Code::Internal => "Internal",
        Code::Unavailable => "Unavailable",
        Code::DataLoss => "DataLoss",
        Code::Unauthenticated => "Unauthenticated",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canceled_is_spelled_as_go_spells_it() {
        assert_eq!(go_code_name(tonic::Code::Cancelled), "Canceled");
        assert_eq!(go_code_name(tonic::Code::Unavailable), "Unavailable");
    }
}
