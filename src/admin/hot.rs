//! `/admin/v1/hot`: the busiest clients through this gateway.

use actix_web::{web, HttpResponse};
use serde::Serialize;
use utoipa::ToSchema;

use crate::state::AppState;

#[derive(Serialize, ToSchema)]
pub struct HotList {
    /// Busiest first, over the last 10 s, on this gateway.
    pub items: Vec<crate::limiter::HotClient>,
}

/// The busiest clients through this gateway: candidates for sharding by region.
#[utoipa::path(operation_id = "listHot", get, path = "/admin/v1/hot", tag = "clients",
    responses((status = 200, description = "Busiest clients, estimated from a 1-in-16 sample", body = HotList)),
    security(("bearer" = [])))]
pub async fn hot(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok().json(HotList {
        items: (*state.limiter.hot().top()).clone(),
    })
}
